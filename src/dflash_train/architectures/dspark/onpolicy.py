"""DSpark in the on-policy stage: Draft-OPD (`family/onpolicy.py`) in its layout (slot k of B drafts the token at
`a + k + 1`: B drafts a block), on the distribution its decoding takes the argmax of: slot k's base scores plus the
Markov head's bias from the token committed before it (its state run over the block's committed tokens, as
training teacher-forces it). Both are one softmax over the target's vocabulary: the hidden state and the Markov
feature side by side against the lm_head and `markov_w2` side by side, so the chunked cross-entropy trains the head
too. The rnn head reads every slot before, so the stage runs whole blocks."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional

import torch

from ...data.batch import Batch
from ..family.blocks import Blocks
from ..family.onpolicy import DraftLogProbs, OnPolicyObjective, softmax_log_probs
from .blocks import dspark_blocks
from .options import options_of


@dataclass
class MarkovBlocks(Blocks):
    previous: torch.Tensor  # [B, N, bs] long: the token before each slot's label (the anchor at slot 0)

    def to(self, device: torch.device) -> "MarkovBlocks":
        return MarkovBlocks(**self.moved(device))


class DSparkOnPolicyObjective(OnPolicyObjective):
    first_draft_slot = 0
    whole_blocks = True

    def __init__(self, drafter, target, backend, cfg, compute_dtype):
        super().__init__(drafter, target, backend, cfg, compute_dtype)
        # q does not read the confidence head: it stays as the finished run trained it, frozen, so that DDP (built
        # after the objective) holds no trained parameter that a step leaves without a gradient
        if drafter.with_confidence:
            drafter.confidence_head.requires_grad_(False)

    def build_blocks(self, plan: Batch, anchors: torch.Tensor, keep: torch.Tensor) -> MarkovBlocks:
        d = self.drafter
        blocks, previous = dspark_blocks(plan.input_ids, plan.loss_mask, plan.lengths, anchors, keep, d.block_size,
                                         d.mask_token_id, options_of(self.cfg).decay_gamma)
        return MarkovBlocks(**{f.name: getattr(blocks, f.name) for f in fields(blocks)}, previous=previous)

    def draft_log_probs(self, rows: torch.Tensor, blocks: MarkovBlocks, idx: torch.Tensor, labels: torch.Tensor,
                        rej: torch.Tensor, drafts: torch.Tensor, out: Optional[torch.Tensor] = None) -> DraftLogProbs:
        d, head, chunk = self.drafter, self.target.lm_head.weight, self.cfg.objective.loss_chunk_size
        if not d.markov_rank:
            return softmax_log_probs(rows, head, labels, rej, drafts, chunk)
        feature, _ = d.markov(out.view(*blocks.labels.shape, -1), blocks.previous)
        feature = feature.reshape(-1, feature.shape[-1]).index_select(0, idx).to(rows.dtype)
        weight = torch.cat([head, d.markov_head.markov_w2.weight.to(head.dtype)], 1)
        return softmax_log_probs(torch.cat([rows, feature], 1), weight, labels, rej, drafts, chunk)
