"""Validation during training: a teacher-forced acceptance estimate on held-out micro-batches, and
real speculative decoding (block verification, greedy) on a few held-out prompts."""

from __future__ import annotations

import numpy as np
import torch

from ..data.dataset import collate, plan_batches
from ..infer.spec_decode import SpeculativeDecoder
from .step import TrainStep, acceptance_estimate, forward_loss


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
            for i, rows in enumerate(plan):
                batch = collate([val.example(r) for r in rows], pad_id).to(device)
                g = torch.Generator().manual_seed(cfg.run.seed * 7919 + i)  # the same anchors at every validation
                stats = forward_loss(drafter, train_step.target, train_step.backend, batch, cfg, g, train_step.compute_dtype)
                loss_sum += float(stats.loss)
                correct += float(stats.correct_per_slot.sum())
                counted += float(stats.counted_per_slot.sum())
                accepted += float(stats.accepted_sum)
                kept += float(stats.kept_blocks)
            out.update(val_loss=loss_sum / max(len(plan), 1), val_accuracy=correct / max(counted, 1),
                       val_tau_estimate=accepted / max(kept, 1))
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


__all__ = ["validate", "acceptance_estimate"]
