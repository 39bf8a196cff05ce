"""Domino's training objective: the shifted labels (slot k of the block at a predicts `input_ids[a + k + 1]`,
every slot counted), the GRU teacher-forced over the block's ground-truth tokens, and `(1 - l) * final + l * base`:
the cross-entropies of the corrected and of the backbone's scores, `l` falling linearly from
`domino.lambda_base_start` to 0 over `domino.lambda_base_decay_ratio` of the run.

Both go through one chunked pass of the lm_head (`loss.chunked_domino_rows`): the base scores are the corrected ones
without the correction `embed_proj[2](a)` (`a` the bottleneck, zero on the pure-draft slots), so the two terms share
one vocabulary-wide product, and neither `[rows, vocab]` logits tensor exists.

Slot weights (`objective.slot_weighting`, both terms alike): `exp(-k / gamma)` (the reference's recipe, Domino's
default), or the family's acceptance or dpace weights (`family.objective.row_weights`) of the final scores' label
probabilities. Teacher-forced, the final distribution at slot k is the one decoding drafts slot k from when every
draft before it was accepted (on the pure-draft slots it is the backbone's own), so the product of the final label
probabilities over the slots before k is the drafter's probability of reaching slot k; slot 0 is the first draft,
reached always. These weights come from a gradient-free chunked pass before the loss's (`loss.final_label_logp`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ...data.batch import Batch
from ..family.blocks import Blocks, build_blocks
from ..family.objective import BlockObjective, row_weights, shifted_stats, slot_weighting_text
from ..stats import StepStats
from .loss import chunked_domino_rows, final_label_logp
from .model import DominoDrafter
from .options import options_of


@dataclass
class DominoBlocks(Blocks):
    tokens: torch.Tensor  # [B, N, bs] long: the ground-truth tokens at a + 0 .. a + bs - 1 (the GRU's inputs)

    def to(self, device: torch.device) -> "DominoBlocks":
        return DominoBlocks(**self.moved(device))


def lambda_base(step: int, total_steps: int, start: float, decay_ratio: float) -> float:
    """The base loss's weight at `step`: `start * (1 - min(step / horizon, 1))`, horizon
    `max(1, floor(total_steps * decay_ratio))`; 0 with no horizon (decay_ratio or total_steps 0)."""
    horizon = int(total_steps * decay_ratio)
    if horizon <= 0:
        return 0.0
    return min(max(start * (1.0 - min(step / horizon, 1.0)), 0.0), 1.0)


def shifted_blocks(input_ids: torch.Tensor, loss_mask: torch.Tensor, lengths: torch.Tensor, anchors: torch.Tensor,
                   keep: torch.Tensor, block_size: int, mask_token_id: int, gamma: float) -> DominoBlocks:
    """DFlash's blocks at `anchors` (inputs, positions, the mask's layout) with the labels one token on: slot k
    predicts `input_ids[a + k + 1]`, counted iff the block is kept, `a + k + 1 < length` and
    `loss_mask[a + k + 1]`, weighed `exp(-k / gamma)`."""
    same = build_blocks(input_ids, loss_mask, lengths, anchors, keep, block_size, mask_token_id, gamma)
    after = build_blocks(input_ids, loss_mask, lengths, anchors + 1, keep, block_size, mask_token_id, gamma)
    seq = input_ids.shape[1]
    first = (anchors + 1).clamp(max=seq - 1)
    first_counted = keep & (anchors + 1 < lengths.view(-1, 1)) & (torch.gather(loss_mask, 1, first) > 0)
    counted = torch.cat([first_counted.unsqueeze(-1), after.counted[..., 1:]], dim=-1)
    k = torch.arange(block_size, device=input_ids.device, dtype=torch.float32)
    weights = torch.exp(-k / gamma).view(1, 1, -1) * counted
    return DominoBlocks(anchors=same.anchors, keep=same.keep, block_ids=same.block_ids,
                        block_positions=same.block_positions, labels=after.labels, weights=weights, counted=counted,
                        tokens=same.labels)


class DominoObjective(BlockObjective):
    drafter: DominoDrafter

    def __init__(self, drafter, target, backend, cfg, compute_dtype):
        super().__init__(drafter, target, backend, cfg, compute_dtype)
        self.lambda_base = lambda_base(0, 0, 0.0, 0.0)

    def describe(self) -> str:
        o = options_of(self.cfg)
        return (f"final (corrected) + base cross-entropy, the base's weight from {o.lambda_base_start:g} to 0 over "
                f"{o.lambda_base_decay_ratio:g} of the steps; {slot_weighting_text(self.cfg)}")

    def begin_step(self, step: int, total_steps: int) -> None:
        """The base loss's weight for this optimizer step (`TrainStep` calls this before its micro-batches)."""
        o = options_of(self.cfg)
        self.lambda_base = lambda_base(step, total_steps, o.lambda_base_start, o.lambda_base_decay_ratio)

    def build_blocks(self, plan: Batch, anchors: torch.Tensor, keep: torch.Tensor) -> DominoBlocks:
        """The shifted layout (`shifted_blocks`) at the anchors the family draws."""
        return shifted_blocks(plan.input_ids, plan.loss_mask, plan.lengths, anchors, keep, self.drafter.block_size,
                              self.drafter.mask_token_id, self.cfg.objective.gamma)

    def __call__(self, batch: Batch, generator: torch.Generator, call=None,
                 hidden: Optional[torch.Tensor] = None) -> StepStats:
        hidden, _ = self.capture(batch, hidden)
        blocks, idx = self.plan_blocks(batch, generator)
        rows = self.block_rows(batch, hidden, blocks, idx, call or self.drafter)
        with self.autocast(batch.input_ids.device):
            return self.domino_loss(rows, blocks, idx)

    def prefix_rows(self, blocks: DominoBlocks, idx: torch.Tensor) -> torch.Tensor:
        """The GRU's states `[M, G]` of the counted rows, over the target's embeddings of the blocks' ground-truth
        tokens (teacher forcing)."""
        b, n, bs = blocks.tokens.shape
        with torch.no_grad():
            embeds = self.target.embed_tokens(blocks.tokens.view(b * n, bs))
        states = self.drafter.prefix_states(embeds)
        return states.reshape(b * n * bs, -1).index_select(0, idx)

    def domino_loss(self, rows: torch.Tensor, blocks: DominoBlocks, idx: torch.Tensor) -> StepStats:
        drafter, o = self.drafter, self.cfg.objective
        labels = blocks.labels.view(-1).index_select(0, idx)
        slot = idx % drafter.block_size
        corrected = (slot >= drafter.pure_draft_prefix_len).unsqueeze(1)
        features = drafter.correction_features(rows, self.prefix_rows(blocks, idx))
        features = torch.where(corrected, features, torch.zeros_like(features))
        head, correction = self.target.lm_head.weight, drafter.embed_proj[2].weight
        transform = {"output_multiplier": drafter.output_multiplier, "softcap": drafter.final_logit_softcapping}
        weights = row_weights(self.cfg, blocks, idx)
        if callable(weights):  # acceptance, dpace: of the final scores' label probabilities, known before the loss
            weights = weights(final_label_logp(rows.detach(), features.detach(), head, correction.detach(), labels,
                                               o.loss_chunk_size, **transform))
        weights = weights.to(torch.promote_types(rows.dtype, torch.float32))
        norm = weights / weights.sum().clamp_min(1e-12)
        lam = self.lambda_base
        res = chunked_domino_rows(rows, features, head, correction, labels, (1.0 - lam) * norm, lam * norm,
                                  o.loss_chunk_size, **transform)
        stats = shifted_stats(res.loss, res.final_correct, blocks, idx)
        stats.extra = {"final_loss": (res.final_ce * norm).sum().detach(),
                       "base_loss": (res.base_ce * norm).sum().detach(), "base_accuracy": res.base_correct.sum()}
        return stats
