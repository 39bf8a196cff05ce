"""Weighted cross-entropy through the frozen lm_head, in chunks: full logits never exist.

Forward computes, chunk by chunk, the logits, the per-row CE, the argmax and the gradient with
respect to the hidden states (softmax - onehot) @ W; backward only scales that stored gradient.
The lm_head weight is frozen, so no weight gradient is ever formed. Two matmuls per row: the least
an lm_head + CE with an input gradient can do.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


class _ChunkedLinearCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, row_weights, chunk_size: int):
        # hidden [M, H] (compute dtype), weight [V, H], labels [M], row_weights [M] (sum normalised by caller)
        m = hidden.shape[0]
        acc_dtype = torch.promote_types(hidden.dtype, torch.float32)  # float32, or float64 in tests
        total = torch.zeros((), device=hidden.device, dtype=acc_dtype)
        correct = torch.zeros(m, device=hidden.device, dtype=torch.bool)
        grad_hidden = torch.empty_like(hidden) if hidden.requires_grad else None
        for start in range(0, m, chunk_size):
            end = min(start + chunk_size, m)
            h = hidden[start:end]
            logits = (h @ weight.t()).to(acc_dtype)  # [c, V]
            lse = torch.logsumexp(logits, dim=-1)
            target_logit = logits.gather(1, labels[start:end].unsqueeze(1)).squeeze(1)
            w = row_weights[start:end]
            total = total + ((lse - target_logit) * w).sum()
            correct[start:end] = logits.argmax(-1) == labels[start:end]
            if grad_hidden is not None:
                probs = torch.softmax(logits, dim=-1)
                probs.scatter_add_(1, labels[start:end].unsqueeze(1), -torch.ones_like(w).unsqueeze(1))
                probs.mul_(w.unsqueeze(1))
                grad_hidden[start:end] = (probs.to(h.dtype) @ weight.to(h.dtype)).to(hidden.dtype)
        ctx.save_for_backward(grad_hidden if grad_hidden is not None else torch.empty(0))
        ctx.mark_non_differentiable(correct)
        return total, correct

    @staticmethod
    def backward(ctx, grad_total, _grad_correct):
        (grad_hidden,) = ctx.saved_tensors
        return grad_hidden * grad_total.to(grad_hidden.dtype), None, None, None, None


@dataclass
class LossOutput:
    loss: torch.Tensor  # scalar: sum_i w_i CE_i / sum_i w_i
    correct: torch.Tensor  # [M] bool: argmax == label, per counted row
    weight_sum: torch.Tensor


def chunked_weighted_ce(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    labels: torch.Tensor,
    weights: torch.Tensor,
    chunk_size: int = 2048,
) -> LossOutput:
    """`hidden [M, H]`, `labels [M]`, `weights [M]` (only rows that count; all weights > 0)."""
    weight_sum = weights.sum()
    acc_dtype = torch.promote_types(hidden.dtype, torch.float32)
    norm = weights.to(acc_dtype) / weight_sum.to(acc_dtype).clamp_min(1e-12)
    total, correct = _ChunkedLinearCE.apply(hidden, lm_head_weight, labels, norm, chunk_size)
    return LossOutput(total, correct, weight_sum)

