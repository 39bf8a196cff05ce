"""One DFlash training step, start to end: target capture -> anchors and blocks -> mask ->
drafter forward -> chunked decayed CE -> backward -> clip -> AdamW -> schedule."""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch

from ..config import Config
from ..data.batch import Batch
from ..model.attention import AttentionBackend
from ..model.drafter import DFlashDrafter
from ..model.target import TargetCapture, TargetHead
from ..runtime import to_device
from .blocks import Blocks, acceptance_weights, build_blocks, sample_anchors
from .dist import HostCopy
from .loss import chunked_weighted_ce


@dataclass
class StepStats:
    """Sums over a step (tensors on the device: read them only when logging)."""

    loss: torch.Tensor
    correct_per_slot: torch.Tensor  # [bs] counted slots predicted right
    counted_per_slot: torch.Tensor  # [bs] counted slots
    accepted_sum: torch.Tensor  # sum over kept blocks of the acceptance-length estimate
    kept_blocks: torch.Tensor
    grad_norm: torch.Tensor | None = None

    @staticmethod
    def sum(parts: "list[StepStats]") -> "StepStats":
        """Counts add up over micro-batches; the loss is their mean."""
        return StepStats(
            loss=torch.stack([p.loss for p in parts]).mean(),
            correct_per_slot=sum(p.correct_per_slot for p in parts),
            counted_per_slot=sum(p.counted_per_slot for p in parts),
            accepted_sum=sum(p.accepted_sum for p in parts),
            kept_blocks=sum(p.kept_blocks for p in parts),
        )


@dataclass
class MicroBatch:
    batch: Batch
    hidden: torch.Tensor | None = None  # the target's capture, when another rank computed it


def make_optimizer(drafter: DFlashDrafter, cfg: Config, device: torch.device) -> torch.optim.AdamW:
    o = cfg.optim
    return torch.optim.AdamW(
        [p for p in drafter.parameters() if p.requires_grad],
        lr=o.lr,
        betas=o.betas,
        eps=o.eps,
        weight_decay=o.weight_decay,
        fused=True,  # also what lets a non-finite step be skipped on the device (`found_inf`)
    )


def lr_factor(step: int, total_steps: int, warmup_ratio: float, min_lr_ratio: float, schedule: str,
              decay_ratio: float) -> float:
    """Linear warmup over `warmup_ratio` of the steps, then `cosine` down to `min_lr_ratio`, or `wsd`:
    constant peak, then the last `decay_ratio` of the steps decay linearly to `min_lr_ratio` (reached as
    the run ends, like the cosine: the last step is one decay step above it)."""
    warmup = int(math.ceil(warmup_ratio * total_steps))
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "wsd":
        decay = max(int(math.ceil(decay_ratio * total_steps)), 1)
        decay_start = max(total_steps - decay, warmup)
        if step < decay_start:
            return 1.0
        progress = min((step - decay_start) / max(total_steps - decay_start, 1), 1.0)
        return min_lr_ratio + (1 - min_lr_ratio) * (1 - progress)
    progress = (step - warmup) / max(total_steps - warmup, 1)
    progress = min(max(progress, 0.0), 1.0)
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def acceptance_estimate(correct: torch.Tensor) -> torch.Tensor:
    """`[..., bs]` correctness of slots 1..bs-1 (slot 0 ignored) -> `1 + leading run of correct slots`."""
    return 1 + correct[..., 1:].long().cumprod(-1).sum(-1)


def _distill_rows(final: torch.Tensor, blocks: Blocks, idx: torch.Tensor) -> torch.Tensor:
    """The target's final normed hidden state that predicted each counted slot's label: slot k of the
    block at a predicts `input_ids[a + k]`, which the target read off position `a + k - 1` (k >= 1)."""
    b, s, h = final.shape
    source = (blocks.block_positions - 1).clamp(min=0) + torch.arange(b, device=final.device).view(-1, 1) * s
    return final.reshape(b * s, h).index_select(0, source.view(-1).index_select(0, idx))


def row_weights(cfg: Config, blocks: Blocks, idx: torch.Tensor):
    """The counted rows' loss weights: the gamma decay, or (acceptance) a function of the rows' label
    log-probabilities that the loss calls after its forward."""
    o = cfg.objective
    if o.slot_weighting == "gamma":
        return blocks.weights.view(-1).index_select(0, idx)

    def by_acceptance(label_logp: torch.Tensor) -> torch.Tensor:
        full = label_logp.new_zeros(blocks.counted.numel()).index_put((idx,), label_logp)
        w = acceptance_weights(full.view(blocks.counted.shape), blocks.counted, o.acceptance_floor)
        return w.view(-1).index_select(0, idx)

    return by_acceptance


def forward_loss(
    drafter: DFlashDrafter,
    target: TargetCapture,
    backend: AttentionBackend,
    batch: Batch,
    cfg: Config,
    generator: torch.Generator,
    compute_dtype: torch.dtype,
    call=None,
    hidden: torch.Tensor | None = None,
) -> StepStats:
    """The drafter's loss on one micro-batch (graph kept for backward). `call` runs the drafter's
    forward (its DDP wrapper on several ranks); attributes are read from `drafter`. `hidden` is the
    target's capture of `batch` when another rank computed it (split placement); else `target` runs."""
    call = call or drafter
    bs = drafter.block_size
    o = cfg.objective
    distill = o.distill_weight > 0
    final = None
    if hidden is None:
        if distill:
            hidden, final = target.capture(batch.input_ids, with_final=True)  # + [B, S, H] final normed
        else:
            hidden = target(batch.input_ids)  # [B, S, K*H], no grad
    elif distill:
        raise ValueError("objective.distill_weight > 0 needs the target's final hidden states, which a capture "
                         "computed on another rank (parallel.placement=split) does not carry")
    # Anchors, blocks and the counted rows have data-dependent sizes: planned on the host copy of the batch
    # when there is one, so that reading them never waits for the device.
    plan = batch.host if batch.host is not None else batch
    anchors, keep = sample_anchors(plan.loss_mask, plan.lengths, bs, o.max_anchors, generator,
                                   backend.blocks_multiple_of, o.max_anchors_per_batch)
    blocks: Blocks = build_blocks(
        plan.input_ids, plan.loss_mask, plan.lengths, anchors, keep, bs, drafter.mask_token_id, o.gamma
    )
    idx = blocks.counted.view(-1).nonzero().squeeze(1)  # the counted rows
    device = batch.input_ids.device
    blocks, idx = blocks.to(device), to_device(idx, device)
    b, s = batch.input_ids.shape
    with torch.no_grad():
        block_embeds = target.embed_tokens(blocks.block_ids)
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
    mask = backend.build_mask(blocks.anchors, blocks.keep, s, bs)
    device_type = device.type
    autocast = (
        torch.autocast(device_type, dtype=compute_dtype)
        if compute_dtype in (torch.bfloat16, torch.float16)
        else contextlib.nullcontext()
    )
    with autocast:
        out = call(hidden, block_embeds, position_ids, backend.attention, mask,
                   compiled_layers=drafter.layers_compiled)  # [B, N*bs, H]
        rows = out.reshape(-1, out.shape[-1]).index_select(0, idx)
        result = chunked_weighted_ce(
            rows,
            target.lm_head.weight,
            blocks.labels.view(-1).index_select(0, idx),
            row_weights(cfg, blocks, idx),
            o.loss_chunk_size,
            target_hidden=_distill_rows(final, blocks, idx) if distill else None,
            distill_weight=o.distill_weight,
            temperature=o.distill_temperature,
        )
    correct = torch.zeros_like(blocks.counted).view(-1).index_put((idx,), result.correct)
    correct = correct.view(blocks.labels.shape)  # [B, N, bs]
    accept = acceptance_estimate(correct)
    return StepStats(
        loss=result.loss,
        correct_per_slot=correct.sum((0, 1)),
        counted_per_slot=blocks.counted.sum((0, 1)),
        accepted_sum=(accept * blocks.keep).sum(),
        kept_blocks=blocks.keep.sum(),
    )


class TrainStep:
    """Holds what a step needs and runs it. `__call__` does one optimizer step on one micro-batch per rank,
    without waiting for the device. A step whose loss or gradients are not finite is skipped on the device
    (the fused AdamW's `found_inf`) and counted there; `max_bad_steps` in a row stop the run, seen by the
    host a step or two later (a copy it reads once it has landed) or at once by `raise_if_diverged`."""

    max_bad_steps = 5

    def __init__(
        self,
        drafter: DFlashDrafter,
        target: "TargetCapture | TargetHead",
        backend: AttentionBackend,
        cfg: Config,
        total_steps: int,
        compute_dtype: torch.dtype,
        device: torch.device,
        group=None,
        rank: int = 0,
        replicas: int | None = None,
    ):
        self.drafter, self.target, self.backend, self.cfg = drafter, target, backend, cfg
        self.compute_dtype = compute_dtype
        # `group` / `replicas`: the ranks that train the drafter together (DDP); `rank`: this rank's index.
        self.rank = rank
        self.model = drafter
        if replicas is None:
            replicas = torch.distributed.get_world_size(group) if torch.distributed.is_initialized() else 1
        if replicas > 1:
            from torch.nn.parallel import DistributedDataParallel

            self.model = DistributedDataParallel(drafter, device_ids=[device.index] if device.type == "cuda" else None,
                                                 process_group=group)
        self.optimizer = make_optimizer(drafter, cfg, device)
        o = cfg.optim
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer,
            lambda step: lr_factor(step, total_steps, o.warmup_ratio, o.min_lr_ratio, o.schedule, o.decay_ratio),
        )
        self.generator = torch.Generator()
        # On the device: steps skipped, the current run of skipped steps, and the longest run so far.
        self._skipped, self._bad_run, self._worst_run = (torch.zeros((), dtype=torch.int64, device=device)
                                                         for _ in range(3))
        # On a GPU, a host copy of the longest run, refreshed without waiting and read once it has landed.
        self._worst_seen = HostCopy(self._worst_run) if device.type == "cuda" else None

    @property
    def skipped_steps(self) -> int:
        return int(self._skipped)

    @skipped_steps.setter
    def skipped_steps(self, value: int) -> None:  # a resumed run's count
        self._skipped.fill_(value)

    def raise_if_diverged(self, step: int, worst: int | None = None) -> None:
        """FloatingPointError after `max_bad_steps` skipped steps in a row (reads the device unless given)."""
        worst = int(self._worst_run) if worst is None else worst
        if worst >= self.max_bad_steps:
            raise FloatingPointError(
                f"{worst} steps in a row had non-finite loss or gradients (by step {step}); "
                "stopping with the last good checkpoint kept. Lower optim.lr or check the data"
            )

    def __call__(self, micro: "Batch | list[MicroBatch]", step: int) -> StepStats:
        """One optimizer step over this rank's micro-batches (gradient accumulation when several:
        the loss is their mean; DDP all-reduces once, on the last)."""
        if isinstance(micro, Batch):
            micro = [MicroBatch(micro)]
        self.drafter.train()
        self.optimizer.zero_grad(set_to_none=True)
        parts: list[StepStats] = []
        for k, mb in enumerate(micro):
            # Anchors depend only on (seed, step, rank, k): a resumed run draws the same ones.
            self.generator.manual_seed(((self.cfg.run.seed * 1_000_003 + step) * 1024 + self.rank) * 64 + k)
            last = k == len(micro) - 1
            sync = contextlib.nullcontext() if last or self.model is self.drafter else self.model.no_sync()
            with sync:
                part = forward_loss(self.drafter, self.target, self.backend, mb.batch, self.cfg, self.generator,
                                    self.compute_dtype, self.model, mb.hidden)
                (part.loss / len(micro)).backward()
            part.loss = part.loss.detach()
            parts.append(part)
        stats = StepStats.sum(parts)
        clip = self.cfg.optim.grad_clip
        params = [p for p in self.drafter.parameters() if p.grad is not None]
        stats.grad_norm = torch.nn.utils.clip_grad_norm_(params, clip if clip > 0 else float("inf"))
        # After DDP's all-reduce every rank sees the same norm, so every rank takes the same decision.
        bad = ~(torch.isfinite(stats.grad_norm) & torch.isfinite(stats.loss))
        self.optimizer.found_inf = bad.float()  # the fused AdamW leaves weights, moments and step count alone
        self.optimizer.step()
        self._skipped += bad
        self._bad_run.mul_(bad).add_(bad)
        torch.maximum(self._worst_run, self._bad_run, out=self._worst_run)
        self.scheduler.step()
        self._check_without_waiting(step)
        return stats

    def _check_without_waiting(self, step: int) -> None:
        if self._worst_seen is None:  # CPU: reading is free
            return self.raise_if_diverged(step)
        if not self._worst_seen.landed():
            return  # an earlier step's copy is still on its way
        if self._worst_seen.posted:
            self.raise_if_diverged(step, int(self._worst_seen.value()))
        self._worst_seen.post(self._worst_run)
