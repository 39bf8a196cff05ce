"""DSpark's CE + L1 terms through the frozen lm_head, in chunks (full `[rows, vocab]` logits never exist).

A counted row i has the drafter's hidden state h_i, its Markov feature f_i (rank r) and the target's final normed
hidden state t_i that predicted the same label. Per chunk: `z = h W^T + f W2^T` (the lm_head W [V, H] frozen, the
Markov table W2 [V, r] trained), `p = softmax(z)`, `p_t = softmax(t W^T)`,
  CE_i = logsumexp(z_i) - z_i[y_i],   L1_i = sum_v |p_iv - p_t,iv|.
D-PARD adds the Renyi-1/2 divergence `R_i = -2 log sum_v sqrt(p_t,iv p_iv)`, whose gradient is
`dR_i/dz_i = p_i - m_i` with `m_i = softmax((log p_t,i + log p_i) / 2)` (the normalised geometric mean).
The loss is `sum_i a_i CE_i + b_i L1_i (+ c_i R_i)` with detached row coefficients a, b, c (the slot weights,
normalised and scaled by the term weights), so the forward forms the gradient too:
  dL/dz_i = a_i (p_i - onehot(y_i)) + b_i p_i * (s_i - <s_i, p_i>) (+ c_i (p_i - m_i)),   s = sign(p - p_t),
and from it the gradients of h, f and W2, chunk by chunk; the backward only scales them by the incoming scalar.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..dflash.loss import chunk_bounds


def _chunk(z: torch.Tensor, target_logits: torch.Tensor, labels: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
           c: Optional[torch.Tensor]):
    lse = torch.logsumexp(z, -1)
    log_p = z - lse.unsqueeze(1)
    p = torch.exp(log_p)
    log_p_t = torch.log_softmax(target_logits, -1)
    p_t = torch.exp(log_p_t)
    ce = lse - z.gather(1, labels.unsqueeze(1)).squeeze(1)
    diff = p - p_t
    l1 = diff.abs().sum(-1)
    s = torch.sign(diff)
    grad = b.unsqueeze(1) * p * (s - (s * p).sum(-1, keepdim=True))
    grad = grad + a.unsqueeze(1) * p
    grad[torch.arange(labels.shape[0], device=z.device), labels] -= a
    renyi = None
    if c is not None:  # in place over log p_t (no longer needed): D-PARD adds no [rows, V] tensor to the peak
        mean = log_p_t.add_(log_p).mul_(0.5)
        mean_lse = torch.logsumexp(mean, -1)
        renyi = -2 * mean_lse
        m = mean.sub_(mean_lse.unsqueeze(1)).exp_()
        grad.addcmul_(c.unsqueeze(1), m.neg_().add_(p))  # c (p - m)
    return ce, l1, renyi, z.argmax(-1) == labels, grad


class _ChunkedDSpark(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, feature, head, w2, target_hidden, labels, a, b, c, chunk_size: int):
        acc = torch.promote_types(hidden.dtype, torch.float32)
        m = hidden.shape[0]
        ce = torch.empty(m, dtype=acc, device=hidden.device)
        l1 = torch.empty(m, dtype=acc, device=hidden.device)
        renyi = torch.zeros(m, dtype=acc, device=hidden.device)
        correct = torch.empty(m, dtype=torch.bool, device=hidden.device)
        w = head.to(hidden.dtype)
        g_hidden = torch.empty_like(hidden) if hidden.requires_grad else None
        g_feature = torch.empty_like(feature) if feature is not None and feature.requires_grad else None
        g_w2 = torch.zeros_like(w2) if w2 is not None and w2.requires_grad else None
        w2c = w2.to(feature.dtype) if feature is not None else None
        for start, end in chunk_bounds(m, chunk_size):
            z = (hidden[start:end] @ w.t()).to(acc)
            if feature is not None:
                z = z + (feature[start:end] @ w2c.t()).to(acc)
            t_logits = (target_hidden[start:end].to(hidden.dtype) @ w.t()).to(acc)
            ce[start:end], l1[start:end], r, correct[start:end], g = _chunk(
                z, t_logits, labels[start:end], a[start:end].to(acc), b[start:end].to(acc),
                None if c is None else c[start:end].to(acc))
            if r is not None:
                renyi[start:end] = r
            if g_hidden is not None:
                g_hidden[start:end] = (g.to(hidden.dtype) @ w).to(hidden.dtype)
            if g_feature is not None:
                g_feature[start:end] = (g.to(feature.dtype) @ w2c).to(feature.dtype)
            if g_w2 is not None:
                g_w2 += (g.t().to(feature.dtype) @ feature[start:end]).to(g_w2.dtype)
        loss = (a.to(acc) * ce + b.to(acc) * l1).sum()
        if c is not None:
            loss = loss + (c.to(acc) * renyi).sum()
        ctx.grads = (g_hidden, g_feature, g_w2)
        ctx.mark_non_differentiable(ce, l1, renyi, correct)
        return loss, ce, l1, renyi, correct

    @staticmethod
    def backward(ctx, grad_loss, *_):
        g_hidden, g_feature, g_w2 = ctx.grads
        scale = [None if g is None else g * grad_loss.to(g.dtype) for g in (g_hidden, g_feature, g_w2)]
        return scale[0], scale[1], None, scale[2], None, None, None, None, None, None


@dataclass
class DSparkRows:
    loss: torch.Tensor  # scalar: sum_i a_i CE_i + b_i L1_i (+ c_i R_i) (differentiable in hidden, feature, w2)
    ce: torch.Tensor  # [M] (no gradient)
    l1: torch.Tensor  # [M] sum_v |p - p_t| (no gradient)
    renyi: torch.Tensor  # [M] -2 log sum_v sqrt(p p_t), 0 without renyi coefficients (no gradient)
    correct: torch.Tensor  # [M] the corrected logits' argmax is the label


def chunked_dspark_rows(hidden: torch.Tensor, feature: Optional[torch.Tensor], head: torch.Tensor,
                        w2: Optional[torch.Tensor], target_hidden: torch.Tensor, labels: torch.Tensor,
                        ce_coef: torch.Tensor, l1_coef: torch.Tensor, chunk_size: int = 2048,
                        renyi_coef: Optional[torch.Tensor] = None) -> DSparkRows:
    """`hidden [M, H]`, `feature [M, r]` and `w2 [V, r]` (None without a Markov head), the frozen `head [V, H]`,
    `target_hidden [M, H]`, `labels [M]`, the detached row coefficients `ce_coef`, `l1_coef` (and D-PARD's
    `renyi_coef`) `[M]`."""
    loss, ce, l1, renyi, correct = _ChunkedDSpark.apply(
        hidden, feature, head, w2, target_hidden, labels, ce_coef.detach(), l1_coef.detach(),
        None if renyi_coef is None else renyi_coef.detach(), chunk_size)
    return DSparkRows(loss, ce, l1, renyi, correct)
