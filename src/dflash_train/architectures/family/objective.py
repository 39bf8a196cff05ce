"""The block objective the members' objectives subclass, on one micro-batch: target capture -> anchors and blocks
(`plan_blocks`, laid out by `build_blocks`) -> masks (one per layer kind) -> drafter forward -> the counted rows'
hidden states, which `rows_loss` turns into the step's loss and sums; the chunked slot-weighted CE of the drafter's
scores as decoding ranks them (`BlockDrafter.embed_block` inputs, `BlockDrafter.logits`' multiplier and softcap) is
here for the members that train it (`unary_rows`, `unary_loss`)."""

from __future__ import annotations

import contextlib
import functools
from typing import Callable, Optional

import torch

from ...config.schema import Config
from ...data.batch import Batch
from ...runtime import to_device
from ..stats import StepStats, acceptance_estimate
from .backend import AttentionBackend
from .blocks import Blocks, acceptance_weights, build_blocks, dpace_weights, sample_anchors
from .loss import CEOptions, LossOutput, RowLoss, chunked_ce_rows, weighted_rows
from .model import BlockDrafter
from .reference_fields import target_to_draft


def _distill_rows(final: torch.Tensor, blocks: Blocks, idx: torch.Tensor) -> torch.Tensor:
    """The target's final normed hidden state that predicted each counted slot's label: slot k of the
    block at a predicts `input_ids[a + k]`, which the target read off position `a + k - 1` (k >= 1)."""
    b, s, h = final.shape
    source = (blocks.block_positions - 1).clamp(min=0) + torch.arange(b, device=final.device).view(-1, 1) * s
    return final.reshape(b * s, h).index_select(0, source.view(-1).index_select(0, idx))


def row_weights(cfg: Config, blocks: Blocks, idx: torch.Tensor, mode: Optional[str] = None):
    """The counted rows' loss weights: the gamma decay (`blocks.weights`), or (acceptance, dpace) a function of the
    rows' label log-probabilities `[M]`, laid out over the blocks' counted slots: the plain CE calls it after its
    forward, a loss that forms its gradients with the weights calls it on a gradient-free pass before. `mode`:
    gamma, acceptance or dpace (default objective.slot_weighting)."""
    o = cfg.objective
    mode = mode or o.slot_weighting
    if mode == "gamma":
        return blocks.weights.view(-1).index_select(0, idx)
    if mode == "acceptance":
        per_block = functools.partial(acceptance_weights, floor=o.acceptance_floor)
    else:
        per_block = functools.partial(dpace_weights, alpha=o.dpace_alpha)

    def by_prediction(label_logp: torch.Tensor) -> torch.Tensor:
        full = label_logp.new_zeros(blocks.counted.numel()).index_put((idx,), label_logp)
        w = per_block(full.view(blocks.counted.shape), blocks.counted)
        return w.view(-1).index_select(0, idx)

    return by_prediction


def slot_weighting_text(cfg: Config) -> str:
    """objective.slot_weighting in words (the run's log)."""
    o = cfg.objective
    if o.slot_weighting == "gamma":
        return f"slots weighted exp(-k / {o.gamma:g}) (objective.slot_weighting gamma)"
    if o.slot_weighting == "acceptance":
        return (f"slots weighted by the drafter's probability of reaching them, floor {o.acceptance_floor:g} "
                "(objective.slot_weighting acceptance)")
    return f"D-PACE slot weights, alpha {o.dpace_alpha:g} (objective.slot_weighting dpace)"


def ce_text(cfg: Config) -> str:
    """The slot-weighted CE (with distillation) in words (the run's log)."""
    o = cfg.objective
    return f"cross-entropy on the data's next tokens; {slot_weighting_text(cfg)}" + (
        f"; + {o.distill_weight:g} x KL to the target (temperature {o.distill_temperature:g})"
        if o.distill_weight > 0 else "")


class BlockObjective:
    """Holds what the loss needs (the drafter, the frozen target, the attention backend, the config and the
    compute dtype) and computes it on one micro-batch (`contract.Objective`). A member gives `rows_loss` and
    `describe`, and may lay out its blocks otherwise (`build_blocks`) or run its own `__call__`."""

    def __init__(self, drafter: BlockDrafter, target, backend: AttentionBackend, cfg: Config,
                 compute_dtype: torch.dtype):
        self.drafter, self.target, self.backend, self.cfg = drafter, target, backend, cfg
        self.compute_dtype = compute_dtype

    def describe(self) -> str:
        """What this objective optimises, for the run's log: each member states its own."""
        raise NotImplementedError(f"{type(self).__name__} must define describe() (what it optimises)")

    def capture(self, batch: Batch, hidden: Optional[torch.Tensor]):
        """(features `[B, S, K*H]`, the target's final normed hidden states or None): the target runs here
        unless another rank's capture is given."""
        distill = self.cfg.objective.distill_weight > 0
        if hidden is not None:
            if distill:
                raise ValueError("objective.distill_weight > 0 needs the target's final hidden states, which a "
                                 "capture computed on another rank (parallel.placement=split) does not carry")
            return hidden, None
        if distill:
            return self.target.capture(batch.input_ids, with_final=True)
        return self.target(batch.input_ids), None  # no grad

    def plan_blocks(self, batch: Batch, generator: torch.Generator) -> tuple[Blocks, torch.Tensor]:
        """Anchors, blocks and the counted rows on the device. Their sizes are data-dependent, so they are
        planned on the host copy of the batch when there is one: reading them never waits for the device."""
        o, bs = self.cfg.objective, self.drafter.block_size
        plan = batch.host if batch.host is not None else batch
        anchors, keep = sample_anchors(plan.loss_mask, plan.lengths, bs, o.max_anchors, generator,
                                       self.backend.blocks_multiple_of, o.max_anchors_per_batch)
        blocks = self.build_blocks(plan, anchors, keep)
        idx = blocks.counted.view(-1).nonzero().squeeze(1)
        device = batch.input_ids.device
        return blocks.to(device), to_device(idx, device)

    def build_blocks(self, plan: Batch, anchors: torch.Tensor, keep: torch.Tensor) -> Blocks:
        """The blocks at `anchors` (`keep`: which are real) of the host batch `plan`: same-position labels, gamma
        weights (`blocks.build_blocks`)."""
        return build_blocks(plan.input_ids, plan.loss_mask, plan.lengths, anchors, keep, self.drafter.block_size,
                            self.drafter.mask_token_id, self.cfg.objective.gamma)

    def __call__(self, batch: Batch, generator: torch.Generator, call: Optional[Callable] = None,
                 hidden: Optional[torch.Tensor] = None) -> StepStats:
        hidden, final = self.capture(batch, hidden)
        blocks, idx = self.plan_blocks(batch, generator)
        rows = self.block_rows(batch, hidden, blocks, idx, call or self.drafter)
        with self.autocast(batch.input_ids.device):
            return self.rows_loss(rows, blocks, idx, final)

    def autocast(self, device: torch.device):
        """The compute dtype's autocast around the drafter's forward and the loss (master weights stay float32)."""
        if self.compute_dtype in (torch.bfloat16, torch.float16):
            return torch.autocast(device.type, dtype=self.compute_dtype)
        return contextlib.nullcontext()

    def block_rows(self, batch: Batch, hidden: torch.Tensor, blocks: Blocks, idx: torch.Tensor,
                   call: Callable) -> torch.Tensor:
        """The drafter's final hidden states `[M, H]` of the counted rows (graph kept)."""
        drafter, backend = self.drafter, self.backend
        device = batch.input_ids.device
        b, s = batch.input_ids.shape
        with torch.no_grad():
            block_embeds = drafter.embed_block(self.target.embed_tokens, blocks.block_ids)
        if drafter.layers_compiled and torch.is_grad_enabled():
            # Dynamo guards on requires_grad: an input that needs no gradient would give the first layer graphs
            # of its own. One set for all layers costs the first layer's q/k/v input gradient (~0.6% of a step).
            block_embeds.requires_grad_()
        pad = -s % backend.context_multiple_of
        if pad:  # padded context keys lie past every anchor: no block ever sees them
            hidden = torch.nn.functional.pad(hidden, (0, 0, 0, pad))
            s += pad
        context_pos = torch.arange(s, device=device).expand(b, s)
        position_ids = torch.cat([context_pos, blocks.block_positions], dim=1)
        bs = drafter.block_size
        mask = drafter.layer_masks(lambda kind: backend.build_mask(blocks.anchors, blocks.keep, s, bs, kind))
        with self.autocast(device):
            out = call(hidden, block_embeds, position_ids, backend.attention, mask,
                       compiled_layers=drafter.layers_compiled)  # [B, N*bs, H]
            return out.reshape(-1, out.shape[-1]).index_select(0, idx)

    def scored_labels(self, blocks: Blocks, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """(the counted rows' labels as the head's classes, the head's weight, whether some may be -1): the
        target's ids and lm_head, or with a reduced draft vocabulary the draft ids (-1 outside it) and the
        drafter's own head."""
        labels = blocks.labels.view(-1).index_select(0, idx)
        head = self.target.lm_head.weight
        if not self.drafter.draft_vocab_size:
            return labels, head, False
        return target_to_draft(self.drafter.d2t, head.shape[0])[labels], self.drafter.lm_head.weight, True

    def unary_rows(self, rows: torch.Tensor, blocks: Blocks, idx: torch.Tensor, final: Optional[torch.Tensor],
                   top_k: int = 0) -> tuple[RowLoss, torch.Tensor, bool]:
        """(the counted rows' unweighted CE results through the drafter's vocabulary head (`loss.RowLoss`), their
        labels as the head's classes, whether some may be -1): the target's lm_head, or the drafter's own over a
        reduced vocabulary, where a label outside it is a miss that adds no loss."""
        o = self.cfg.objective
        labels, head, unscored = self.scored_labels(blocks, idx)
        options = CEOptions(o.loss_chunk_size, o.distill_weight, o.distill_temperature, self.drafter.output_multiplier,
                            self.drafter.final_logit_softcapping, top_k, unscored, self.cfg.keeps_head_gradient)
        target_hidden = _distill_rows(final, blocks, idx) if final is not None else None
        return chunked_ce_rows(rows, head, labels, options, target_hidden), labels, unscored

    def unary_loss(self, rows: torch.Tensor, blocks: Blocks, idx: torch.Tensor, final: Optional[torch.Tensor],
                   top_k: int = 0) -> LossOutput:
        """The slot-weighted CE of the counted rows (`unary_rows`), weighted by `row_weights`."""
        out, labels, unscored = self.unary_rows(rows, blocks, idx, final, top_k)
        return weighted_rows(out, labels, row_weights(self.cfg, blocks, idx), unscored)

    def rows_loss(self, rows: torch.Tensor, blocks: Blocks, idx: torch.Tensor,
                  final: Optional[torch.Tensor]) -> StepStats:
        """The step's loss and sums from the counted rows' final hidden states `rows [M, H]` (graph kept) and the
        target's final normed hidden states `final` (None unless the capture formed them). A member that keeps the
        shared micro-batch path defines it; one that replaces the path (its own `__call__`) never reaches it."""
        raise NotImplementedError(f"{type(self).__name__} keeps the shared micro-batch path but defines no rows_loss")


def block_stats(loss: torch.Tensor, correct_rows: torch.Tensor, blocks: Blocks, idx: torch.Tensor) -> StepStats:
    """The step's sums from the counted rows' hits `[M]` (a draft equal to its label)."""
    correct = torch.zeros_like(blocks.counted).view(-1).index_put((idx,), correct_rows)
    correct = correct.view(blocks.labels.shape)  # [B, N, bs]
    accept = acceptance_estimate(correct)
    return StepStats(
        loss=loss,
        correct_per_slot=correct.sum((0, 1)),
        counted_per_slot=blocks.counted.sum((0, 1)),
        accepted_sum=(accept * blocks.keep).sum(),
        kept_blocks=blocks.keep.sum(),
        work=blocks.work,
    )


def shifted_stats(loss: torch.Tensor, correct_rows: torch.Tensor, blocks: Blocks, idx: torch.Tensor) -> StepStats:
    """The step's sums in a shifted layout, where every slot drafts (slot k the token at a + k + 1): a block's
    acceptance estimate is 1 plus the leading run of correct slots from slot 0."""
    correct = torch.zeros_like(blocks.counted).view(-1).index_put((idx,), correct_rows).view(blocks.labels.shape)
    accept = 1 + correct.long().cumprod(-1).sum(-1)
    return StepStats(loss=loss, correct_per_slot=correct.sum((0, 1)), counted_per_slot=blocks.counted.sum((0, 1)),
                     accepted_sum=(accept * blocks.keep).sum(), kept_blocks=blocks.keep.sum(), work=blocks.work)
