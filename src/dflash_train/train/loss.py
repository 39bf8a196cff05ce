"""Weighted cross-entropy through the frozen lm_head, in chunks: full logits never exist.

Forward computes, chunk by chunk, the logits, the per-row CE, the argmax and the gradient with
respect to the hidden states (softmax - onehot) @ W; backward only scales that stored gradient.
The lm_head weight is frozen, so no weight gradient is ever formed. Two matmuls per row: the least
an lm_head + CE with an input gradient can do.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def _ce_chunk(logits: torch.Tensor, labels: torch.Tensor, w: torch.Tensor):
    """One chunk's weighted CE sum, argmax hits and d(loss)/d(logits), from logits `[c, V]`.
    Written as plain elementwise + reductions so that on GPU it compiles to ~two passes over the logits."""
    x = logits.to(torch.promote_types(logits.dtype, torch.float32))
    lse = torch.logsumexp(x, dim=-1)
    target_logit = x.gather(1, labels.unsqueeze(1)).squeeze(1)
    loss = ((lse - target_logit) * w).sum()
    correct = x.argmax(-1) == labels
    probs = torch.exp(x - lse.unsqueeze(1))
    is_label = torch.arange(x.shape[1], device=x.device).unsqueeze(0) == labels.unsqueeze(1)
    grad = (torch.where(is_label, probs - 1, probs) * w.unsqueeze(1)).to(logits.dtype)
    return loss, correct, grad


def _ce_chunk_fn(device: torch.device):
    """The compiled chunk math on CUDA (one graph, dynamic rows); eager elsewhere."""
    if device.type != "cuda":
        return _ce_chunk
    from ..model.compile import compiled

    return compiled("ce_chunk", _ce_chunk, dynamic=True)


class _ChunkedLinearCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, row_weights, chunk_size: int):
        # hidden [M, H] (compute dtype), weight [V, H], labels [M], row_weights [M] (sum normalised by caller)
        m = hidden.shape[0]
        acc_dtype = torch.promote_types(hidden.dtype, torch.float32)  # float32, or float64 in tests
        total = torch.zeros((), device=hidden.device, dtype=acc_dtype)
        correct = torch.zeros(m, device=hidden.device, dtype=torch.bool)
        grad_hidden = torch.empty_like(hidden) if hidden.requires_grad else None
        ce_chunk = _ce_chunk_fn(hidden.device)
        for start in range(0, m, chunk_size):
            end = min(start + chunk_size, m)
            h = hidden[start:end]
            logits = h @ weight.t()  # [c, V], compute dtype (bf16 under autocast)
            loss, hits, grad_logits = ce_chunk(logits, labels[start:end], row_weights[start:end].to(acc_dtype))
            total = total + loss
            correct[start:end] = hits
            if grad_hidden is not None:
                grad_hidden[start:end] = (grad_logits @ weight.to(grad_logits.dtype)).to(hidden.dtype)
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

