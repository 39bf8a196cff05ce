"""Validation during training on held-out micro-batches: a teacher-forced acceptance estimate over random
anchors, the greedy block-decoding walk along each response (`val_tau_walk`: real decoding's tau when the
responses are the target's own greedy output, as regenerated data is), and real speculative decoding
(block verification, greedy) on a few held-out prompts."""

from __future__ import annotations

import numpy as np
import torch

from ..data.batch import collate
from ..data.dataset import plan_batches
from ..infer.replay import teacher_forced_walk
from ..infer.spec_decode import SpeculativeDecoder
from ..algorithms.base import acceptance_estimate
from .step import TrainStep


@torch.no_grad()
def validate(train_step: TrainStep, val, pad_id: int, device: torch.device, *, batches: int, prompts: int,
             max_new_tokens: int, stop_token_ids: list[int]) -> dict:
    cfg = train_step.cfg
    drafter = train_step.drafter
    out: dict = {}
    was_training = drafter.training
    drafter.eval()
    try:
        if batches:
            plan = plan_batches(val.lengths, cfg.data.token_budget, cfg.data.max_batch_size, cfg.run.seed, 0)[:batches]
            correct = counted = accepted = kept = 0.0
            loss_sum = 0.0
            walk_accepts: list[int] = []
            for i, rows in enumerate(plan):
                batch = collate([val.example(r) for r in rows], pad_id).to(device)
                g = torch.Generator().manual_seed(cfg.run.seed * 7919 + i)  # the same anchors at every validation
                hidden = train_step.target(batch.input_ids)
                walk_accepts += _walks(train_step, batch, hidden)
                stats = train_step.objective(batch, g, hidden=None if cfg.objective.distill_weight > 0 else hidden)
                loss_sum += float(stats.loss)
                correct += float(stats.correct_per_slot.sum())
                counted += float(stats.counted_per_slot.sum())
                accepted += float(stats.accepted_sum)
                kept += float(stats.kept_blocks)
            out.update(val_loss=loss_sum / max(len(plan), 1), val_accuracy=correct / max(counted, 1),
                       val_tau_estimate=accepted / max(kept, 1),
                       val_tau_walk=sum(walk_accepts) / max(len(walk_accepts), 1))
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
    finally:
        drafter.train(was_training)
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
