"""One training step, start to end: the architecture's objective on each micro-batch (target capture,
blocks, drafter forward, loss) -> backward -> clip -> AdamW -> schedule. Generic: the algorithm is reached
through its `Architecture` (the one the run's start resolved, `rank_checks.Admitted.arch`)."""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch

from ...architectures import architecture
from ...architectures.contract import Architecture
from ...architectures.drafter import Drafter
from ...architectures.stats import StepStats
from ...config.schema import Config
from ...data.batch import Batch
from ...target.capture import TargetCapture, TargetHead
from ..processes.dist import HostCopy


@dataclass
class MicroBatch:
    batch: Batch
    hidden: torch.Tensor | None = None  # the target's capture, when another rank computed it


def make_optimizer(drafter: Drafter, cfg: Config, arch: Architecture) -> torch.optim.AdamW:
    """AdamW over the architecture's parameter groups (`Architecture.parameter_groups`; by default every trained
    parameter at `optim.lr`; a group with an "lr" of its own keeps its ratio through the schedule)."""
    o = cfg.optim
    return torch.optim.AdamW(
        arch.parameter_groups(drafter, cfg),
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


class TrainStep:
    """Holds what a step needs and runs it. `__call__` does one optimizer step on one micro-batch per rank,
    without waiting for the device. A step whose loss or gradients are not finite is skipped on the device
    (the fused AdamW's `found_inf`) and counted there; `max_bad_steps` in a row stop the run, seen by the
    host a step or two later (a copy it reads once it has landed) or at once by `raise_if_diverged`."""

    max_bad_steps = 5

    def __init__(
        self,
        drafter: Drafter,
        target: "TargetCapture | TargetHead",
        backend,
        cfg: Config,
        total_steps: int,
        compute_dtype: torch.dtype,
        device: torch.device,
        group=None,
        rank: int = 0,
        replicas: int | None = None,
        arch: Architecture | None = None,
    ):
        self.drafter, self.target, self.backend, self.cfg = drafter, target, backend, cfg
        # The run's architecture: a run passes the one its start resolved; a step built alone resolves the config's.
        self.arch = arch if arch is not None else architecture(cfg.drafter.architecture)
        self.compute_dtype = compute_dtype
        self.total_steps = total_steps
        # The loss on one micro-batch, also what validation and the warm-up run.
        objective = self.arch.onpolicy_objective if cfg.onpolicy.start_from else self.arch.objective
        self.objective = objective(drafter, target, backend, cfg, compute_dtype)
        # `group` / `replicas`: the ranks that train the drafter together (DDP); `rank`: this rank's index.
        self.rank, self.group = rank, group
        self.model = drafter
        if replicas is None:
            replicas = torch.distributed.get_world_size(group) if torch.distributed.is_initialized() else 1
        if replicas > 1:
            from torch.nn.parallel import DistributedDataParallel

            self.model = DistributedDataParallel(drafter, device_ids=[device.index] if device.type == "cuda" else None,
                                                 process_group=group)
        self.optimizer = make_optimizer(drafter, cfg, self.arch)
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
        begin = getattr(self.objective, "begin_step", None)
        if begin is not None:  # an objective with a schedule of its own (e.g. a loss weight over the run)
            begin(step, self.total_steps)
        parts: list[StepStats] = []
        for k, mb in enumerate(micro):
            # Anchors depend only on (seed, step, rank, k): a resumed run draws the same ones.
            self.generator.manual_seed(((self.cfg.run.seed * 1_000_003 + step) * 1024 + self.rank) * 64 + k)
            last = k == len(micro) - 1
            sync = contextlib.nullcontext() if last or self.model is self.drafter else self.model.no_sync()
            with sync:
                part = self.objective(mb.batch, self.generator, self.model, mb.hidden)
                # a loss normalised over the whole step trains on its sum here, divided once every share is known
                (part.loss * part.normaliser if part.normaliser is not None else part.loss / len(micro)).backward()
            part.loss = part.loss.detach()
            parts.append(part)
        stats = StepStats.sum(parts)
        params = [p for p in self.drafter.parameters() if p.grad is not None]
        if stats.normaliser is not None:
            self._divide_by_the_steps_normaliser(params, stats.normaliser)
        clip = self.cfg.optim.grad_clip
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

    def _divide_by_the_steps_normaliser(self, params: list[torch.nn.Parameter], local: torch.Tensor) -> None:
        """Gradients of the summed losses -> of their mean over every rank's terms: DDP has averaged the ranks'
        sums, so times the replicas over the normalisers' total (one all-reduce, no wait for the device)."""
        total, replicas = local.detach().clone(), 1
        if self.model is not self.drafter:
            torch.distributed.all_reduce(total, group=self.group)
            replicas = torch.distributed.get_world_size(self.group)
        torch._foreach_mul_([p.grad for p in params], replicas / total.clamp_min(1e-6))

    def _check_without_waiting(self, step: int) -> None:
        if self._worst_seen is None:  # CPU: reading is free
            return self.raise_if_diverged(step)
        if not self._worst_seen.landed():
            return  # an earlier step's copy is still on its way
        if self._worst_seen.posted:
            self.raise_if_diverged(step, int(self._worst_seen.value()))
        self._worst_seen.post(self._worst_run)
