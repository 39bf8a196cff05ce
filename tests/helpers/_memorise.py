"""A drafter taught these exact sequences (every anchor of every block) until it predicts much of them: a drafter
that is often right, so that acceptance lengths vary and comparisons of decoders mean something. Not a test module."""

from __future__ import annotations

import torch

from dflash_train.architectures.attention import sdpa_attention
from dflash_train.architectures.drafter import Drafter
from dflash_train.architectures.family.mask import dense_mask

IGNORE = -100  # a label the drafter's vocabulary cannot score (outside a reduced draft vocabulary): no loss


def _label_of(drafter: Drafter):
    """Target id -> the drafter's class: itself, or its draft id (IGNORE outside a reduced vocabulary)."""
    if not drafter.draft_vocab_size:
        return lambda token: token
    t2d = {int(t): i for i, t in enumerate(drafter.vocabulary_ids())}
    return lambda token: t2d.get(token, IGNORE)


def memorise(drafter: Drafter, target, sequences: list[list[int]], steps: int = 20) -> Drafter:
    """Trains in float32 whatever the drafter's dtype (it is returned in its own): a float64 drafter's steps over
    the full 49,152-token head took ~2.5x longer, for a drafter no better at being often right. A drafter whose
    every slot drafts (`num_drafts() == block_size`, DSpark) learns slot k's token at anchor + k + 1 (its Markov
    bias left as it is); else slots 1..B-1 learn the tokens after the anchor (the anchor's slot has no label)."""
    bs = drafter.block_size
    first = bs - drafter.num_drafts()  # the first slot that drafts: 1 (DFlash), 0 (DSpark)
    label_of = _label_of(drafter)
    dtype = next(drafter.parameters()).dtype
    drafter.float()
    opt = torch.optim.Adam(drafter.parameters(), lr=1e-2)
    embed = target.get_input_embeddings()
    head = drafter.vocabulary_head(target.get_output_embeddings())
    if head is target.get_output_embeddings():  # the target's (frozen) head: a float32 copy of its weight
        weight = head.weight.detach().float()
        head = lambda x: torch.nn.functional.linear(x, weight)  # noqa: E731
    batches = []
    for ids in sequences:
        with torch.no_grad():
            hs = target(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states
        context = torch.cat([hs[i + 1] for i in drafter.target_layer_ids], -1).float()
        anchors = torch.arange(1, len(ids) - bs + first)
        block = torch.tensor(ids)[anchors.view(-1, 1) + torch.arange(bs + 1 - first)]  # the anchor, then labels
        inputs = torch.full_like(block[:, :bs], drafter.mask_token_id)
        inputs[:, 0] = block[:, 0]
        positions = torch.cat([torch.arange(len(ids)), (anchors.view(-1, 1) + torch.arange(bs)).view(-1)]).view(1, -1)
        mask = dense_mask(anchors.view(1, -1), torch.ones(1, len(anchors), dtype=torch.bool), len(ids), bs)
        labels = torch.tensor([[label_of(int(t)) for t in row] for row in block[:, 1:]])
        batches.append((context, embed(inputs.view(1, -1)).detach().float(), positions, mask, labels))
    drafter.train()
    for _ in range(steps):
        for context, block_embeds, positions, mask, labels in batches:
            out = drafter(context, block_embeds, positions, sdpa_attention, mask)
            logits = head(out[0].view(labels.shape[0], bs, -1)[:, first:])
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                                     ignore_index=IGNORE)
            opt.zero_grad()
            loss.backward()
            opt.step()
    return drafter.to(dtype).eval()
