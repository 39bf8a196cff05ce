"""The DSpark objective on one micro-batch (the reference's): with slot weights w (`blocks.slot_weights` times the
cumulative mask) normalised over the micro-batch's counted slots,
  L = ce_weight * sum w CE + l1_weight * sum w ||p - p_t||_1 + confidence_weight * sum w BCE(c, c*),
where p is the drafter's Markov-corrected distribution (the previous token teacher-forced), p_t the target's at the
position that predicted the label (its final normed hidden state through the frozen lm_head), and
`c* = clamp(1 - ||p - p_t||_1 / 2, 0, 1)`, detached, the slot's analytic acceptance at temperature 1. With
`dspark.slot_weights` acceptance or dpace, the CE and L1 terms take DFlash's weights of those names instead (from
the drafter's detached label probabilities, a gradient-free first pass), the BCE keeps the decay.

D-PARD (`dspark.loss: dpard`, SpecForge's) replaces the CE and L1 terms by
  sum over counted slots t of W_t R_t / (the micro-batch's sequences),
  R_t = -2 log sum_v sqrt(p_t(v) p(v)),   W_t = sum_{k >= t in the block} prod_{i <= k} s_i  (detached),
  s_i = alpha + (1 - alpha) c*_i for a counted slot, 1 for one that does not count,
the confidence BCE unchanged. W needs every slot's acceptance first: a gradient-free pass through the chunked head
computes it, then the chunked loss runs with W as the Renyi coefficients."""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, Optional

import torch

from ...data.batch import Batch
from ...runtime import to_device
from ..family.blocks import Blocks
from ..family.objective import BlockObjective, row_weights
from ..stats import StepStats
from .blocks import plan
from .loss import TargetPositions, chunked_dspark_rows, target_positions
from .options import loss_weights, options_of


class DSparkObjective(BlockObjective):
    def describe(self) -> str:
        o = options_of(self.cfg)
        if o.loss == "dpard":
            terms = (f"D-PARD's Renyi-1/2 actor, each slot weighted by its expected accepted length (alpha "
                     f"{o.dpard_alpha:g})")
        else:
            ce, l1 = loss_weights(o)
            weights = (f"exp(-k / {o.decay_gamma:g})" if o.slot_weights == "decay" else
                       f"as objective.slot_weighting {o.slot_weights} weighs DFlash's (dspark.slot_weights)")
            terms = f"{ce:g} x CE + {l1:g} x L1 to the target's distribution, slots weighted {weights}"
        if self.drafter.with_confidence:
            terms += f"; + {o.confidence_weight:g} x confidence BCE (exp(-k / {o.decay_gamma:g}) slot weights)"
        return terms + "; objective.slot_weighting and objective.gamma do not apply to DSpark"

    def __call__(self, batch: Batch, generator: torch.Generator, call: Optional[Callable] = None,
                 hidden: Optional[torch.Tensor] = None) -> StepStats:
        if hidden is not None:
            raise ValueError("DSpark needs the target's final hidden states, which a capture computed on another rank "
                             "(parallel.placement=split) does not carry")
        hidden, final = self.target.capture(batch.input_ids, with_final=True)
        o, d = self.cfg.objective, self.drafter
        host = batch.host if batch.host is not None else batch
        blocks, prev = plan(host.input_ids, host.loss_mask, host.lengths, d.block_size, o.max_anchors, generator,
                            d.mask_token_id, options_of(self.cfg).decay_gamma, self.backend.blocks_multiple_of,
                            o.max_anchors_per_batch)
        idx, source = rows_by_position(blocks, host.input_ids.shape[1])
        targets = target_positions(final, source, o.loss_chunk_size)
        device = batch.input_ids.device
        idx = to_device(idx, device)
        blocks, prev = blocks.to(device), to_device(prev, device)
        every = torch.arange(blocks.counted.numel(), device=device)
        out = self.block_rows(batch, hidden, blocks, every, call or d)  # [B*N*bs, H]
        with self.autocast(device):
            stats = self.dspark_loss(out, targets, blocks, prev, idx)
        if stats.work is not None:
            stats.work = replace(stats.work, target_positions=targets.states.shape[0])
        return stats

    def dspark_loss(self, out: torch.Tensor, targets: TargetPositions, blocks, prev: torch.Tensor,
                    idx: torch.Tensor) -> StepStats:
        """The loss of the drafter's block outputs `out [B*N*bs, H]` over the counted rows `idx` (in the order of
        `targets`, the target's states they read)."""
        d, opts = self.drafter, options_of(self.cfg)
        shape = blocks.labels.shape
        feature, embedding = d.markov(out.view(*shape, -1), prev)
        rows = out.index_select(0, idx)
        pick = (lambda x: None if x is None else x.reshape(-1, x.shape[-1]).index_select(0, idx))
        feature, embedding = pick(feature), pick(embedding)
        acc_dtype = torch.promote_types(rows.dtype, torch.float32)
        decay = blocks.weights.view(-1).index_select(0, idx).to(acc_dtype)
        decay = decay / decay.sum().clamp_min(1e-12)  # the confidence BCE's weights, and by default CE's and L1's
        w2 = d.markov_head.markov_w2.weight if d.markov_rank else None
        labels = blocks.labels.view(-1).index_select(0, idx)
        chunk = self.cfg.objective.loss_chunk_size
        renyi_coef, first = None, None
        if opts.loss == "dpard" or opts.slot_weights != "decay":  # weights from every slot's result: a first pass
            with torch.no_grad():
                first = chunked_dspark_rows(rows.detach(), None if feature is None else feature.detach(),
                                            self.target.lm_head.weight, None if w2 is None else w2.detach(),
                                            targets, labels, torch.zeros_like(decay), torch.zeros_like(decay), chunk)
        norm = decay
        if opts.slot_weights != "decay":
            by_label_logp = row_weights(self.cfg, blocks, idx, opts.slot_weights)
            w = by_label_logp(-first.ce).to(acc_dtype)
            norm = w / w.sum().clamp_min(1e-12)
        if opts.loss == "dpard":
            renyi_coef = dpard_weights((1 - first.l1 / 2).clamp(0, 1), blocks.counted, idx,
                                       opts.dpard_alpha) / shape[0]
        ce_weight, l1_weight = loss_weights(opts)
        res = chunked_dspark_rows(rows, feature, self.target.lm_head.weight, w2, targets, labels,
                                  ce_weight * norm, l1_weight * norm, chunk, renyi_coef)
        loss = res.loss
        acceptance = (1 - res.l1 / 2).clamp(0, 1)  # detached: the chunked terms carry no gradient here
        extra = {"ce_loss": (res.ce * norm).sum().detach(), "l1_loss": (res.l1 * norm).sum().detach(),
                 "acceptance_loss": (acceptance * norm).sum()}
        if renyi_coef is not None:
            extra["renyi_loss"] = (res.renyi * norm).sum().detach()
        if d.with_confidence:
            logit = d.confidence(rows, embedding)
            bce = torch.nn.functional.binary_cross_entropy_with_logits(logit, acceptance.to(logit.dtype),
                                                                       reduction="none")
            conf = (bce * decay.to(bce.dtype)).sum()
            loss = loss + opts.confidence_weight * conf
            extra["confidence_loss"] = conf.detach()
        correct = torch.zeros(blocks.counted.numel(), dtype=torch.bool, device=rows.device)
        correct = correct.index_put((idx,), res.correct).view(shape)
        accepted = correct.long().cumprod(-1).sum(-1)  # drafts accepted before the first miss
        return StepStats(loss=loss, correct_per_slot=correct.sum((0, 1)), counted_per_slot=blocks.counted.sum((0, 1)),
                         accepted_sum=((1 + accepted) * blocks.keep).sum(), kept_blocks=blocks.keep.sum(), extra=extra,
                         work=blocks.work)


def dpard_weights(acceptance: torch.Tensor, counted: torch.Tensor, idx: torch.Tensor, alpha: float) -> torch.Tensor:
    """D-PARD's credit of each counted row (`idx` into the flattened `counted [B, N, bs]`, `acceptance` by counted
    row): `W_t = sum_{k >= t} prod_{i <= k} s_i` along its block, `s_i = alpha + (1 - alpha) acceptance_i` for a
    counted slot and 1 for one that does not count."""
    s = torch.ones(counted.numel(), dtype=acceptance.dtype, device=acceptance.device)
    s = s.index_put((idx,), alpha + (1 - alpha) * acceptance).view(counted.shape)
    prefix = s.cumprod(-1)
    suffix = prefix.flip(-1).cumsum(-1).flip(-1)
    return suffix.reshape(-1).index_select(0, idx)


def rows_by_position(blocks: Blocks, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the counted rows, indices into the flattened `[B, N, bs]` slots, sorted by the target position that
    predicted their label; those positions, flat `b * seq + a + k`), from the blocks where they were planned. Rows
    sharing a position then lie together: a loss chunk forms each position's target logits once."""
    idx = blocks.counted.view(-1).nonzero().squeeze(1)
    rows = torch.arange(blocks.block_positions.shape[0], device=idx.device).view(-1, 1) * seq
    source = (blocks.block_positions + rows).view(-1).index_select(0, idx)
    order = torch.sort(source, stable=True).indices
    return idx.index_select(0, order), source.index_select(0, order)
