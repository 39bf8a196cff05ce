"""Domino's two cross-entropies through one pass of the frozen lm_head, in chunks (full `[rows, vocab]` logits never
exist).

A counted row i has the drafter's hidden state z_i and the correction's bottleneck e_i (`silu(embed_proj[0]([z ;
g]))`, zero on the pure-draft slots). Per chunk: the base scores `u = z W^T` (the lm_head W [V, H] frozen) and the
correction `d = e C^T` (C = `embed_proj[2]` [V, E], trained), the final scores `u + d`, and with the drafter's score
transform T (multiplier, softcap)
  final CE_i = CE(T(u_i + d_i), y_i),   base CE_i = CE(T(u_i), y_i).
The loss is `sum_i a_i final_i + b_i base_i` with detached row coefficients (the slot weights normalised, times
`1 - lambda_base` and `lambda_base`), so the forward forms the gradient too:
  dL/dd_i = a_i (softmax(x_f,i) - onehot(y_i)) T'(u_i + d_i),
  dL/du_i = dL/dd_i + b_i (softmax(x_b,i) - onehot(y_i)) T'(u_i),
and from them the gradients of z (through W), e (through C) and C, chunk by chunk; the backward only scales them.

Both terms share the one vocabulary-wide product `u` (the base scores are the final ones without the correction):
two `[rows, H] x [H, V]` matmuls a row (forward and input gradient), as DFlash's loss, and three narrow ones of
width E for the correction. The elementwise math compiles on CUDA to a few fused passes over the chunk.

Slot weights that depend on the drafter's own predictions (`objective.slot_weighting` acceptance, dpace) must be
known before that pass, which forms the gradients with them: `final_label_logp` first runs the same chunks without
gradient for each row's log-probability of its label under the final scores `T(u_i + d_i)` (two more matmuls a
row: the `[H, V]` product and the correction's `[E, V]` one), from which the caller makes the weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..family.loss import chunk_bounds, chunk_function, transformed_scores


def _ce_and_gradient(z: torch.Tensor, is_label: torch.Tensor, labels: torch.Tensor, coef: torch.Tensor,
                     multiplier: float, softcap: Optional[float]):
    """(CE, hits, d(coef * CE)/dz) of the scores T(z) of float32 (or wider) logits `z [n, V]`."""
    transform = multiplier != 1.0 or bool(softcap)
    x, slope = transformed_scores(z, multiplier, softcap) if transform else (z, None)
    lse = torch.logsumexp(x, -1)
    ce = lse - x.gather(1, labels.unsqueeze(1)).squeeze(1)
    probs = torch.exp(x - lse.unsqueeze(1))
    grad = coef.unsqueeze(1) * torch.where(is_label, probs - 1, probs)
    return ce, x.argmax(-1) == labels, grad if slope is None else grad * slope


def _chunk(u: torch.Tensor, d: torch.Tensor, labels: torch.Tensor, final_coef: torch.Tensor,
           base_coef: torch.Tensor, multiplier: float, softcap: Optional[float]):
    """One chunk of rows: `u [n, V]` the base logits, `d [n, V]` the correction's. Returns (final CE, base CE, final
    hits, base hits, dL/du, dL/dd), the gradients in u's dtype. Plain elementwise math and reductions: compiled,
    both terms' passes read u and d once each and no `[n, V]` intermediate is written."""
    acc = torch.promote_types(u.dtype, torch.float32)
    base = u.to(acc)
    is_label = torch.arange(u.shape[1], device=u.device).unsqueeze(0) == labels.unsqueeze(1)
    final_ce, final_hit, g_final = _ce_and_gradient(base + d.to(acc), is_label, labels, final_coef, multiplier,
                                                    softcap)
    base_ce, base_hit, g_base = _ce_and_gradient(base, is_label, labels, base_coef, multiplier, softcap)
    return final_ce, base_ce, final_hit, base_hit, (g_final + g_base).to(u.dtype), g_final.to(u.dtype)


def _chunk_products(hidden: torch.Tensor, features: torch.Tensor, w: torch.Tensor, c: torch.Tensor,
                    chunk_size: int):
    """Each chunk's `(start, end, e, u, d)`: its bottleneck rows `e` in the compute dtype, the base logits `u = z
    W^T` and the correction's `d = e C^T` (`w`, `c`: the head and the correction's weight in the compute dtype)."""
    for start, end in chunk_bounds(hidden.shape[0], chunk_size):
        e = features[start:end].to(hidden.dtype)
        yield start, end, e, hidden[start:end] @ w.t(), e @ c.t()


def _label_logp_chunk(u: torch.Tensor, d: torch.Tensor, labels: torch.Tensor, multiplier: float,
                      softcap: Optional[float]) -> torch.Tensor:
    """One chunk's `log softmax(T(u + d))[label]` at float32 (or wider): minus the final CE that `_chunk` forms,
    by the same operations. Compiled, one pass reads u and d and writes one value a row."""
    acc = torch.promote_types(u.dtype, torch.float32)
    z = u.to(acc) + d.to(acc)
    x = transformed_scores(z, multiplier, softcap)[0] if multiplier != 1.0 or softcap else z
    return x.gather(1, labels.unsqueeze(1)).squeeze(1) - torch.logsumexp(x, -1)


@torch.no_grad()
def final_label_logp(hidden: torch.Tensor, features: torch.Tensor, head: torch.Tensor, correction: torch.Tensor,
                     labels: torch.Tensor, chunk_size: int = 2048, output_multiplier: float = 1.0,
                     softcap: Optional[float] = None) -> torch.Tensor:
    """`[M]` each row's log-probability of its label under the final scores (`chunked_domino_rows`' arguments),
    without gradient: a pass over the same chunks that forms each chunk's `u` and `d` and keeps one value a row
    (no `[rows, vocab]` tensor). The slot weights of `objective.slot_weighting` acceptance and dpace are made of it
    before `chunked_domino_rows` forms the gradients with them."""
    acc = torch.promote_types(hidden.dtype, torch.float32)
    out = torch.empty(hidden.shape[0], dtype=acc, device=hidden.device)
    multiplier, cap = float(output_multiplier), float(softcap) if softcap else None
    chunk = chunk_function("domino_label_logp", _label_logp_chunk, hidden.device)
    w, c = head.to(hidden.dtype), correction.to(hidden.dtype)
    for start, end, _, u, d in _chunk_products(hidden, features, w, c, chunk_size):
        out[start:end] = chunk(u, d, labels[start:end], multiplier, cap)
    return out


class _ChunkedDomino(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, features, head, correction, labels, final_coef, base_coef, chunk_size: int,
                multiplier: float, softcap: Optional[float]):
        acc = torch.promote_types(hidden.dtype, torch.float32)
        m = hidden.shape[0]
        final_ce = torch.empty(m, dtype=acc, device=hidden.device)
        base_ce = torch.empty(m, dtype=acc, device=hidden.device)
        final_hit = torch.empty(m, dtype=torch.bool, device=hidden.device)
        base_hit = torch.empty(m, dtype=torch.bool, device=hidden.device)
        w, c = head.to(hidden.dtype), correction.to(hidden.dtype)
        g_hidden = torch.empty_like(hidden) if hidden.requires_grad else None
        g_features = torch.empty(features.shape, dtype=hidden.dtype, device=hidden.device) \
            if features.requires_grad else None
        g_correction = torch.zeros_like(correction) if correction.requires_grad else None
        final_coef, base_coef = final_coef.to(acc), base_coef.to(acc)
        chunk = chunk_function("domino_chunk", _chunk, hidden.device)
        for start, end, e, u, d in _chunk_products(hidden, features, w, c, chunk_size):
            final_ce[start:end], base_ce[start:end], final_hit[start:end], base_hit[start:end], g_u, g_d = chunk(
                u, d, labels[start:end], final_coef[start:end], base_coef[start:end], multiplier, softcap)
            if g_hidden is not None:
                g_hidden[start:end] = g_u @ w
            if g_features is not None:
                g_features[start:end] = g_d @ c
            if g_correction is not None:
                g_correction += (g_d.t() @ e).to(g_correction.dtype)
        ctx.grads = (g_hidden, g_features, g_correction)
        ctx.mark_non_differentiable(final_ce, base_ce, final_hit, base_hit)
        loss = (final_coef * final_ce + base_coef * base_ce).sum()
        return loss, final_ce, base_ce, final_hit, base_hit

    @staticmethod
    def backward(ctx, grad_loss, *_):
        scaled = [None if g is None else g * grad_loss.to(g.dtype) for g in ctx.grads]
        return scaled[0], scaled[1], None, scaled[2], None, None, None, None, None, None


@dataclass
class DominoRows:
    loss: torch.Tensor  # scalar: sum_i a_i final_i + b_i base_i (differentiable in hidden, features, correction)
    final_ce: torch.Tensor  # [M] CE of the corrected scores (no gradient)
    base_ce: torch.Tensor  # [M] CE of the backbone's scores (no gradient)
    final_correct: torch.Tensor  # [M] the corrected scores' argmax is the label
    base_correct: torch.Tensor  # [M] the backbone's argmax is the label


def chunked_domino_rows(hidden: torch.Tensor, features: torch.Tensor, head: torch.Tensor, correction: torch.Tensor,
                        labels: torch.Tensor, final_coef: torch.Tensor, base_coef: torch.Tensor,
                        chunk_size: int = 2048, output_multiplier: float = 1.0,
                        softcap: Optional[float] = None) -> DominoRows:
    """`hidden [M, H]`, the bottleneck `features [M, E]` (zero where a row takes no correction), the frozen `head [V,
    H]`, the correction's output weight `correction [V, E]`, `labels [M]`, the detached row coefficients of the final
    and base CE `[M]`; the drafter's score transform (`Drafter.logits`) applied to both."""
    loss, final_ce, base_ce, final_hit, base_hit = _ChunkedDomino.apply(
        hidden, features, head, correction, labels, final_coef.detach(), base_coef.detach(), chunk_size,
        float(output_multiplier), float(softcap) if softcap else None)
    return DominoRows(loss, final_ce, base_ce, final_hit, base_hit)
