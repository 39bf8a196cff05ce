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

What each chunk costs: one matmul of `[h ; f]` with the joint weight `[W ; W2]` (the Markov bias inside the head's
product, not a second `[rows, V]` tensor), one of the target's states with W, and the elementwise math, which on
CUDA compiles to a few fused passes over the chunk (`_chunk`, or `_chunk_values` without the gradient, through
`family.loss.chunk_function`). The blocks overlap (512 anchors in 2,048 tokens at B = 16: ~4 rows a position), so
the rows are sorted by the target position they read and each chunk forms the target's logits once per position
(`TargetPositions`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ...runtime import to_device
from ..family.loss import chunk_bounds, chunk_function


def _chunk(z: torch.Tensor, target_logits: torch.Tensor, where: torch.Tensor, labels: torch.Tensor, a: torch.Tensor,
           b: torch.Tensor, c: Optional[torch.Tensor], with_grad: bool):
    """One chunk of rows: `z [n, V]` the drafter's scores, `target_logits [P, V]` the target's at the positions the
    chunk reads, `where [n]` each row's among them. Returns (CE, L1, Renyi or None, hits, dL/dz in z's dtype or None
    without `with_grad`). Plain elementwise math and reductions, no in-place update: compiled, no `[n, V]`
    intermediate is written (each pass forms what it needs from z and the target's rows, read through `where`,
    never gathered), and the target's log-softmax is reduced once per position, not per row."""
    x = z.to(torch.promote_types(z.dtype, torch.float32))
    lse = torch.logsumexp(x, -1)
    log_p = x - lse.unsqueeze(1)
    p = torch.exp(log_p)
    log_p_t = torch.log_softmax(target_logits.to(x.dtype), -1).index_select(0, where)
    diff = p - torch.exp(log_p_t)
    ce = lse - x.gather(1, labels.unsqueeze(1)).squeeze(1)
    l1 = diff.abs().sum(-1)
    correct = x.argmax(-1) == labels
    renyi = mean = mean_lse = None
    if c is not None:
        mean = (log_p_t + log_p) * 0.5
        mean_lse = torch.logsumexp(mean, -1)
        renyi = -2 * mean_lse
    if not with_grad:
        return ce, l1, renyi, correct, None
    s = torch.sign(diff)
    sp = (s * p).sum(-1, keepdim=True)
    is_label = torch.arange(x.shape[1], device=x.device).unsqueeze(0) == labels.unsqueeze(1)
    grad = p * (a.unsqueeze(1) + b.unsqueeze(1) * (s - sp)) - torch.where(is_label, a.unsqueeze(1), 0.0)
    if c is not None:
        grad = grad + c.unsqueeze(1) * (p - torch.exp(mean - mean_lse.unsqueeze(1)))
    return ce, l1, renyi, correct, grad.to(z.dtype)


def _chunk_values(z: torch.Tensor, target_logits: torch.Tensor, where: torch.Tensor, labels: torch.Tensor,
                  a: torch.Tensor, b: torch.Tensor, c: Optional[torch.Tensor], with_grad: bool):
    """`_chunk` for a pass that needs no gradient (D-PARD's first pass, which finds its slot weights). A function of
    its own, so that it compiles as a graph of its own: Dynamo keeps the graphs of one function together and would
    log `_chunk` without its gradient as a recompile of `_chunk`, in every D-PARD warm-up."""
    return _chunk(z, target_logits, where, labels, a, b, c, with_grad)


@dataclass
class TargetPositions:
    """The target's final normed states that the counted rows read, each position once: `states [P, H]`, `where
    [M]` each row's state, and `spans`, per loss chunk (`chunk_bounds(M, chunk_size)`) the states `[first, end)`
    its rows read. With the rows sorted by position a chunk's states are one run (at the 8B benchmark's overlap about
    a quarter of its rows long)."""

    states: torch.Tensor
    where: torch.Tensor
    spans: list[tuple[int, int]]


def _span(where: torch.Tensor, states: int) -> tuple[int, int]:
    """The states `[first, end)` rows reading `where` (host) need, at least two where there are two: Dynamo
    specialises a size of 1, so a one-state span would be a compiled variant of its own."""
    first, end = int(where.min()), int(where.max()) + 1
    if end - first == 1 and states >= 2:
        first = min(first, states - 2)
        end = first + 2
    return first, end


def target_positions(final: torch.Tensor, source: torch.Tensor, chunk_size: int) -> TargetPositions:
    """`final [B, S, H]` the target's final normed states (device), `source [M]` (host) each counted row's flat
    position `b * S + p` in it, sorted (any order is correct; sorted, each chunk reads the fewest states)."""
    positions, where = torch.unique_consecutive(source, return_inverse=True)
    spans = [_span(where[start:end], positions.numel()) for start, end in chunk_bounds(source.numel(), chunk_size)]
    flat = final.reshape(-1, final.shape[-1])
    return TargetPositions(flat.index_select(0, to_device(positions, flat.device)), to_device(where, flat.device),
                           spans)


class _ChunkedDSpark(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, feature, head, w2, targets: TargetPositions, labels, a, b, c, chunk_size: int):
        acc = torch.promote_types(hidden.dtype, torch.float32)
        m, h = hidden.shape
        ce = torch.empty(m, dtype=acc, device=hidden.device)
        l1 = torch.empty(m, dtype=acc, device=hidden.device)
        renyi = torch.zeros(m, dtype=acc, device=hidden.device)
        correct = torch.empty(m, dtype=torch.bool, device=hidden.device)
        w = head.to(hidden.dtype)
        joint = w if feature is None else torch.cat([w, w2.to(hidden.dtype)], 1)  # [V, H (+ r)]
        wants_rows = hidden.requires_grad or (feature is not None and feature.requires_grad)
        g_rows = torch.empty(m, joint.shape[1], dtype=hidden.dtype, device=hidden.device) if wants_rows else None
        g_w2 = torch.zeros_like(w2) if w2 is not None and w2.requires_grad else None
        with_grad = g_rows is not None or g_w2 is not None
        a, b, c = a.to(acc), b.to(acc), None if c is None else c.to(acc)
        chunk = (chunk_function("dspark_chunk", _chunk, hidden.device) if with_grad
                 else chunk_function("dspark_chunk_values", _chunk_values, hidden.device))
        for (start, end), (first, stop) in zip(chunk_bounds(m, chunk_size), targets.spans):
            rows = hidden[start:end]
            if feature is not None:
                rows = torch.cat([rows, feature[start:end].to(hidden.dtype)], 1)
            z = rows @ joint.t()
            t_logits = targets.states[first:stop].to(hidden.dtype) @ w.t()
            ce[start:end], l1[start:end], r, correct[start:end], g = chunk(
                z, t_logits, targets.where[start:end] - first, labels[start:end], a[start:end], b[start:end],
                None if c is None else c[start:end], with_grad)
            if r is not None:
                renyi[start:end] = r
            if g_rows is not None:
                g_rows[start:end] = g @ joint
            if g_w2 is not None:
                g_w2 += (g.t() @ rows[:, h:]).to(g_w2.dtype)
        loss = (a * ce + b * l1).sum()
        if c is not None:
            loss = loss + (c * renyi).sum()
        g_hidden = g_rows[:, :h] if g_rows is not None and hidden.requires_grad else None
        g_feature = g_rows[:, h:] if g_rows is not None and feature is not None and feature.requires_grad else None
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
                        w2: Optional[torch.Tensor], targets: TargetPositions, labels: torch.Tensor,
                        ce_coef: torch.Tensor, l1_coef: torch.Tensor, chunk_size: int = 2048,
                        renyi_coef: Optional[torch.Tensor] = None) -> DSparkRows:
    """`hidden [M, H]`, `feature [M, r]` and `w2 [V, r]` (None without a Markov head), the frozen `head [V, H]`, the
    target's states the rows read (`targets`, its spans made for this `chunk_size`), `labels [M]`, the detached
    row coefficients `ce_coef`, `l1_coef` (and D-PARD's `renyi_coef`) `[M]`."""
    if len(targets.spans) != len(chunk_bounds(hidden.shape[0], chunk_size)):
        raise ValueError(f"the target positions' spans were made for other chunks than {hidden.shape[0]} rows in "
                         f"chunks of {chunk_size}")
    loss, ce, l1, renyi, correct = _ChunkedDSpark.apply(
        hidden, feature, head, w2, targets, labels, ce_coef.detach(), l1_coef.detach(),
        None if renyi_coef is None else renyi_coef.detach(), chunk_size)
    return DSparkRows(loss, ce, l1, renyi, correct)
