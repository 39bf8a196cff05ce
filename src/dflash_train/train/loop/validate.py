"""Validation during training on held-out micro-batches: a teacher-forced acceptance estimate over random
anchors, the greedy block-decoding walk along each response (`val_tau_walk`: real decoding's tau when the
responses are the target's own greedy output, as regenerated data is), and real speculative decoding
(block verification, greedy) on a few held-out prompts.

The loss part runs the training's compiled code (the target's capture, the drafter's compiled layers and
attention, the loss) under no_grad and in eval mode, on batches of their own sizes: Dynamo compiles those
apart from the training's. Validation's batches are fixed (the first `run.eval_batches` of the validation
plan, each with its own anchors), so the warm-up runs the extremes of their sizes exactly as validation
does (`validation_batches_to_warm_up`, `validation_loss`, `evaluating`) and no validation compiles after
the seal. The walk and the decoding run the eager drafter."""

from __future__ import annotations

import contextlib
from typing import Iterator

import numpy as np
import torch

from ...data.batch import Batch, collate
from ...data.dataset import plan_batches
from ...infer.replay import teacher_forced_walk
from ...infer.spec_decode import SpeculativeDecoder
from ...architectures import reads_target_final
from ...architectures.stats import StepStats, acceptance_estimate
from ..plan import size_classes
from .step import TrainStep


def validation_plan(train_step: TrainStep, val) -> list[list[int]]:
    """The validation batches, the same at every validation: the first `run.eval_batches` of the plan."""
    cfg = train_step.cfg
    return plan_batches(val.lengths, cfg.data.token_budget, cfg.data.max_batch_size, cfg.run.seed, 0)[
        :cfg.run.eval_batches]


@contextlib.contextmanager
def evaluating(drafter: torch.nn.Module) -> Iterator[None]:
    """Validation's mode: no gradient, the drafter in eval mode (restored after)."""
    was_training = drafter.training
    drafter.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        drafter.train(was_training)


def validation_loss(train_step: TrainStep, batch: Batch, index: int) -> tuple[StepStats, torch.Tensor]:
    """The loss on validation batch `index` (under `evaluating`): its anchors are the same at every validation.
    Returns the stats and the target's capture."""
    cfg = train_step.cfg
    g = torch.Generator().manual_seed(cfg.run.seed * 7919 + index)
    hidden = train_step.target(batch.input_ids)
    # an objective that reads the target's final states captures them itself (a given capture holds none)
    stats = train_step.objective(batch, g, hidden=None if reads_target_final(cfg, train_step.arch) else hidden)
    return stats, hidden


def validation_batches_to_warm_up(train_step: TrainStep, val) -> list[tuple[int, tuple[int, ...], list[str]]]:
    """The validation batches at the edges of validation's sizes (`size_classes.EDGES`): (index in
    `validation_plan`, rows, the edges it stands for), each batch once."""
    cfg = train_step.cfg
    plan = validation_plan(train_step, val)
    edges = size_classes.plan_extremes(plan, val.lengths, train_step.drafter.block_size, cfg.objective.max_anchors,
                                       cfg.objective.max_anchors_per_batch, train_step.backend.blocks_multiple_of)
    chosen: dict[int, list[str]] = {}
    for edge, (_, c) in edges.items():
        chosen.setdefault(c.index, []).append(edge)
    return [(i, tuple(plan[i]), names) for i, names in sorted(chosen.items())]


def validate(train_step: TrainStep, val, pad_id: int, device: torch.device, *, batches: int, prompts: int,
             max_new_tokens: int, stop_token_ids: list[int]) -> dict:
    """`batches`: how many of the validation plan's batches (`run.eval_batches`, as `validation_plan` reads it)."""
    drafter = train_step.drafter
    out: dict = {}
    with evaluating(drafter):
        if batches:
            plan = validation_plan(train_step, val)[:batches]
            parts: list[StepStats] = []
            walk_accepts: list[int] = []
            for i, rows in enumerate(plan):
                batch = collate([val.example(r) for r in rows], pad_id).to(device)
                stats, hidden = validation_loss(train_step, batch, i)
                walk_accepts += _walks(train_step, batch, hidden)
                parts.append(stats)
            if parts:
                # as a step pools its micro-batches: a loss over all the batches' terms, or the mean of their means
                total = StepStats.sum(parts)
                counted = float(total.counted_per_slot.sum())
                out.update(val_loss=float(total.loss), val_accuracy=float(total.correct_per_slot.sum()) / max(counted, 1),
                           val_tau_estimate=float(total.accepted_sum) / max(float(total.kept_blocks), 1))
            else:
                out.update(val_loss=0.0, val_accuracy=0.0, val_tau_estimate=0.0)
            out.update(val_tau_walk=sum(walk_accepts) / max(len(walk_accepts), 1))
        if prompts:
            decoder = SpeculativeDecoder(train_step.target.model, drafter, stop_token_ids)
            taus, n_tokens = [], 0
            for i in range(min(prompts, len(val))):
                ex = val.example(i)
                first = int(np.argmax(ex.loss_mask > 0)) if ex.loss_mask.any() else len(ex.input_ids)
                result = decoder.generate_block(ex.input_ids[:first].tolist(), max_new_tokens)
                taus += result.accept_lengths
                n_tokens += len(result.tokens)
            out.update(val_tau=sum(taus) / max(len(taus), 1), val_decoded_tokens=n_tokens)
    return out


def _walks(train_step: TrainStep, batch, hidden: torch.Tensor) -> list[int]:
    """Greedy block decoding walked along each row's response (`teacher_forced_walk`): its accept lengths.
    Each assistant turn (a run of supervised tokens) is walked on its own, from its first token to its last."""
    drafter, target = train_step.drafter, train_step.target
    out: list[int] = []
    for b in range(batch.input_ids.shape[0]):
        length = int(batch.lengths[b])
        mask = (batch.loss_mask[b, :length] > 0).tolist()
        ids = batch.input_ids[b, :length].tolist()
        start = None
        for p, on in enumerate(mask + [False]):
            if on and start is None:
                start = p
            elif not on and start is not None:
                out += teacher_forced_walk(drafter, target.embed_tokens, target.lm_head, hidden[b:b + 1, :p],
                                           ids[:p], start)
                start = None
    return out


__all__ = ["validate", "acceptance_estimate"]
