"""Weighted cross-entropy through an lm_head (the target's frozen one, or a reduced draft vocabulary's own
trained head), in chunks: full logits never exist.

Forward computes, chunk by chunk, the logits, the per-row CE, the label's log-probability, the argmax and
the gradient of each row's CE with respect to its hidden state, (softmax - q) @ W; backward only scales
those stored rows by the incoming per-row gradient (the caller's weights). The target's lm_head weight is frozen,
so no weight gradient is formed for it: two matmuls per row, the least an lm_head + CE with an input gradient
can do. A trained head (a reduced draft vocabulary's) also gets its weight gradient in backward, from the logits
formed again chunk by chunk (two more matmuls per row, over the reduced vocabulary), or with `keep_grad_logits`
from the forward's gradient rows kept for it (`[M, V]` in the compute dtype: one matmul in backward, no second
pass over the chunks).

The target q is the one-hot label, or with distillation `(1 - alpha) * onehot + alpha * p_target` with
`p_target = softmax(lm_head(target_hidden) / T)`, its logits also formed one chunk at a time (one more
matmul per row). Either way d(CE)/d(logits) = softmax(logits) - q.

The drafter's scores may be transformed (`output_multiplier` m, `final_logit_softcapping` c, as decoding ranks
them): x = c * tanh(m * z / c) of the lm_head's z (x = m * z without a cap). The CE is then of x, and the chain
rule gives d(CE)/dz = (softmax(x) - q) * m * (1 - (x / c)^2) (times m alone without a cap). The target's logits
(distillation) are the target's own and are never transformed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Union

import torch


def _ce_chunk(logits: torch.Tensor, labels: torch.Tensor):
    """One chunk's per-row CE, label log-probability, argmax hits and d(CE_i)/d(logits), from logits `[c, V]`.
    Written as plain elementwise + reductions so that on GPU it compiles to ~two passes over the logits."""
    x = logits.to(torch.promote_types(logits.dtype, torch.float32))
    lse = torch.logsumexp(x, dim=-1)
    label_logp = x.gather(1, labels.unsqueeze(1)).squeeze(1) - lse
    correct = x.argmax(-1) == labels
    probs = torch.exp(x - lse.unsqueeze(1))
    is_label = torch.arange(x.shape[1], device=x.device).unsqueeze(0) == labels.unsqueeze(1)
    grad = torch.where(is_label, probs - 1, probs).to(logits.dtype)
    return -label_logp, label_logp, correct, grad


def _ce_chunk_eager(logits: torch.Tensor, labels: torch.Tensor):
    """`_ce_chunk` for eager devices (the CPU), where each pass over the logits costs: four passes (max with
    its index, exp, sum, scale in place) and the one-hot subtracted at one entry per row, against eight. Under
    inductor the in-place form is slower (a float32 copy of the chunk is kept), hence the two versions."""
    x = logits.to(torch.promote_types(logits.dtype, torch.float32))
    peak, top = x.max(dim=-1)
    probs = torch.exp(x - peak.unsqueeze(1))
    total = probs.sum(-1)
    lse = peak + total.log()
    label_logp = x.gather(1, labels.unsqueeze(1)).squeeze(1) - lse
    probs.div_(total.unsqueeze(1))
    probs[torch.arange(labels.shape[0], device=x.device), labels] -= 1
    return -label_logp, label_logp, top == labels, probs.to(logits.dtype)


def _soft_ce_chunk(logits: torch.Tensor, target_logits: torch.Tensor, labels: torch.Tensor, alpha: float,
                   inv_temperature: float):
    """`_ce_chunk` against q = (1 - alpha) * onehot(label) + alpha * softmax(target_logits * inv_temperature).
    The CE is `lse(x) - sum_v q_v x_v` (q sums to 1); label log-probability and hits stay against the label."""
    x = logits.to(torch.promote_types(logits.dtype, torch.float32))
    p_target = torch.softmax(target_logits.to(x.dtype) * inv_temperature, dim=-1)
    lse = torch.logsumexp(x, dim=-1)
    label_logp = x.gather(1, labels.unsqueeze(1)).squeeze(1) - lse
    correct = x.argmax(-1) == labels
    is_label = torch.arange(x.shape[1], device=x.device).unsqueeze(0) == labels.unsqueeze(1)
    q = p_target * alpha + is_label.to(x.dtype) * (1.0 - alpha)
    loss = lse - (q * x).sum(-1)
    grad = (torch.exp(x - lse.unsqueeze(1)) - q).to(logits.dtype)
    return loss, label_logp, correct, grad


def chunk_function(name: str, fn: Callable, device: torch.device, eager: Optional[Callable] = None) -> Callable:
    """The compiled chunk math on CUDA (one graph, dynamic rows); elsewhere `eager`, or `fn` itself."""
    if device.type != "cuda":
        return eager or fn
    from ...accel.compile import compiled

    return compiled(name, fn, dynamic=True)


def chunk_bounds(m: int, chunk_size: int) -> list[tuple[int, int]]:
    """`[start, end)` of each chunk of `m` rows: `chunk_size` rows each, the last what is left, except that no
    chunk holds a single row when that can be avoided (a remainder of 1 moves one row over from the chunk
    before). The compiled chunk function specialises a size of 1 (Dynamo's 0/1 rule), so a one-row chunk
    would be a compiled variant of its own, met mid-run by any micro-batch of `k * chunk_size + 1` counted rows."""
    bounds = [(start, min(start + chunk_size, m)) for start in range(0, m, chunk_size)]
    if len(bounds) >= 2 and chunk_size >= 3 and m % chunk_size == 1:
        (a, _), (_, e) = bounds[-2], bounds[-1]
        bounds[-2:] = [(a, e - 2), (e - 2, e)]
    return bounds


def grouped_topk(scores: torch.Tensor, k: int, group: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """`scores.topk(k, dim=-1)` of `[c, V]` rows (values, best first, and their ids), found in two small steps:
    the k groups of `group` columns with the largest maxima hold every row's k best entries (an entry among the
    k best lies in a group whose maximum is at least as large, and at most k groups reach the k-th value), so
    one max-pass over the row, a top-k of the `V / group` group maxima and one of the `k * group` gathered
    entries replace a top-k over all V columns (a radix select over 152K columns per row on the GPU). With
    ties the set of values is the same; which of the tied ids comes first may differ from `topk`'s."""
    c, v = scores.shape
    if k * group >= v:
        return scores.topk(k, dim=-1)
    pad = (-v) % group
    padded = torch.nn.functional.pad(scores, (0, pad), value=float("-inf")) if pad else scores
    groups = padded.view(c, -1, group)
    best_groups = groups.amax(-1).topk(k, dim=-1).indices  # [c, k]
    picked = groups.gather(1, best_groups.unsqueeze(-1).expand(c, k, group))  # [c, k, group]
    values, where = picked.view(c, k * group).topk(k, dim=-1)
    ids = best_groups.gather(1, where // group) * group + where % group
    return values, ids


def transformed_scores(logits: torch.Tensor, multiplier: float,
                       softcap: Optional[float]) -> tuple[torch.Tensor, object]:
    """(x, dx/dz) for x = softcap * tanh(multiplier * z / softcap) (or multiplier * z), computed at float32 or
    wider; dx/dz is a tensor with a cap, the number `multiplier` without."""
    z = logits.to(torch.promote_types(logits.dtype, torch.float32))
    x = z * multiplier
    if not softcap:
        return x, multiplier
    t = torch.tanh(x / softcap)
    return t * softcap, (1.0 - t * t) * multiplier


@dataclass(frozen=True)
class CEOptions:
    """How the chunked cross-entropy scores its rows (`chunked_ce_rows`, `chunked_weighted_ce`)."""

    chunk_size: int = 2048  # rows of one lm_head product
    distill_weight: float = 0.0  # share of the target's distribution in each row's target q (needs target_hidden)
    temperature: float = 1.0  # of the target's distribution
    output_multiplier: float = 1.0  # the drafter's score transform (`BlockDrafter.logits`), before the CE
    softcap: Optional[float] = None
    top_k: int = 0  # > 0: each row's k best (transformed) scores too, read off the same chunks
    unscored: bool = False  # labels may be -1: a row with no class of this head (outside a reduced vocabulary)
    keep_grad_logits: bool = False  # a trained head's backward reads the forward's [M, V] gradient rows, kept


class _ChunkedLinearCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, target_hidden, how: CEOptions):
        # hidden [M, H] (compute dtype), weight [V, H], labels [M] (with `unscored`, -1 marks a row without a
        # class: see chunked_ce_rows), target_hidden [M, H] or None
        alpha, temperature = float(how.distill_weight), float(how.temperature)
        chunk_size, top_k = how.chunk_size, how.top_k
        multiplier, softcap = float(how.output_multiplier), float(how.softcap) if how.softcap else None
        unscored, keep_grad_logits = how.unscored, how.keep_grad_logits
        m = hidden.shape[0]
        acc_dtype = torch.promote_types(hidden.dtype, torch.float32)  # float32, or float64 in tests
        rows = torch.empty(m, device=hidden.device, dtype=acc_dtype)
        label_logp = torch.empty(m, device=hidden.device, dtype=acc_dtype)
        correct = torch.empty(m, device=hidden.device, dtype=torch.bool)
        # with top_k: each row's k best logits and their ids, and the label's logit (no gradient)
        top_values = torch.empty(m, top_k, device=hidden.device, dtype=acc_dtype)
        top_ids = torch.empty(m, top_k, device=hidden.device, dtype=torch.long)
        label_logits = torch.empty(m if top_k else 0, device=hidden.device, dtype=acc_dtype)
        grad_hidden = torch.empty_like(hidden) if hidden.requires_grad else None
        train_weight = weight.requires_grad
        if train_weight and target_hidden is not None:
            raise ValueError("a trained lm_head (a reduced draft vocabulary) takes hard labels only, no distillation")
        # A trained head's backward reads each row's d(CE)/d(logits) again: kept here, or formed again there.
        kept = torch.empty(m, weight.shape[0], device=hidden.device, dtype=hidden.dtype) \
            if train_weight and keep_grad_logits else None
        # One cast of a trained head's float32 master weight to the compute dtype, not one per chunk.
        w = weight if weight.dtype == hidden.dtype else weight.to(hidden.dtype)
        scored = labels >= 0 if unscored else None
        safe_labels = labels.clamp_min(0) if unscored else labels  # a row without a class reads column 0, then is reset
        if target_hidden is None:
            ce_chunk = chunk_function("ce_chunk", _ce_chunk, hidden.device, eager=_ce_chunk_eager)
        else:
            soft = chunk_function("soft_ce_chunk", _soft_ce_chunk, hidden.device)
        transform = multiplier != 1.0 or bool(softcap)
        for start, end in chunk_bounds(m, chunk_size):
            logits = hidden[start:end] @ w.t()  # [c, V], compute dtype (bf16 under autocast)
            scores, slope = transformed_scores(logits, multiplier, softcap) if transform else (logits, None)
            if target_hidden is None:
                out = ce_chunk(scores, safe_labels[start:end])
            else:
                target_logits = target_hidden[start:end] @ w.t()
                out = soft(scores, target_logits, safe_labels[start:end], alpha, 1.0 / temperature)
            rows[start:end], label_logp[start:end], correct[start:end], grad_logits = out
            if top_k:  # of the transformed scores (the drafter's unary scores)
                top_values[start:end], top_ids[start:end] = grouped_topk(scores, top_k)
                label_logits[start:end] = scores.gather(1, safe_labels[start:end].unsqueeze(1)).squeeze(1)
            if transform:  # chain rule through the transform, back in the logits' dtype for the matmul
                grad_logits = (grad_logits * slope).to(logits.dtype)
            if grad_hidden is not None:
                grad_hidden[start:end] = (grad_logits @ w.to(grad_logits.dtype)).to(hidden.dtype)
            if kept is not None:
                kept[start:end] = grad_logits
        if unscored:  # a row without a class has no loss, no gradient, no hit, and probability 0 of its label
            rows.masked_fill_(~scored, 0.0)
            label_logp.masked_fill_(~scored, float("-inf"))
            correct &= scored
            if grad_hidden is not None:
                grad_hidden.mul_(scored.unsqueeze(1).to(grad_hidden.dtype))
        if kept is not None:
            saved = (hidden, kept)
        else:
            saved = (hidden, w, safe_labels) if train_weight else ()
        ctx.save_for_backward(grad_hidden if grad_hidden is not None else torch.empty(0), *saved)
        ctx.scored = scored
        ctx.kept = kept is not None
        ctx.recompute = (chunk_size, multiplier, softcap, weight.dtype) if train_weight else None
        ctx.mark_non_differentiable(label_logp, correct, top_values, top_ids, label_logits)
        return rows, label_logp, correct, top_values, top_ids, label_logits

    @staticmethod
    def backward(ctx, grad_rows, *_no_gradient):
        grad_hidden, *saved = ctx.saved_tensors
        grad_in = grad_hidden * grad_rows.unsqueeze(1).to(grad_hidden.dtype) if grad_hidden.numel() else None
        grad_weight = None
        if ctx.kept:
            grad_weight = _weight_gradient_kept(grad_rows, *saved, ctx.scored, ctx.recompute[3])
        elif ctx.recompute:
            grad_weight = _weight_gradient(grad_rows, *saved, ctx.scored, *ctx.recompute)
        return grad_in, grad_weight, None, None, None


def _weight_gradient(grad_rows: torch.Tensor, hidden: torch.Tensor, w: torch.Tensor, labels: torch.Tensor,
                     scored: Optional[torch.Tensor], chunk_size: int, multiplier: float, softcap: Optional[float],
                     dtype: torch.dtype) -> torch.Tensor:
    """d(sum_i grad_rows_i CE_i)/dW of a trained head, chunk by chunk: the logits are formed again (the forward
    keeps no `[M, V]` tensor), then `sum_i g_i (softmax_i - onehot_i) h_i^T`, in `dtype` (the master weight's)."""
    ce_chunk = chunk_function("ce_chunk", _ce_chunk, hidden.device, eager=_ce_chunk_eager)
    transform = multiplier != 1.0 or bool(softcap)
    g = grad_rows if scored is None else grad_rows * scored.to(grad_rows.dtype)
    out = torch.zeros(w.shape, dtype=dtype, device=w.device)
    for start, end in chunk_bounds(hidden.shape[0], chunk_size):
        h = hidden[start:end]
        logits = h @ w.t()
        scores, slope = transformed_scores(logits, multiplier, softcap) if transform else (logits, None)
        grad_logits = ce_chunk(scores, labels[start:end])[3]
        scale = g[start:end].unsqueeze(1)
        if transform:
            grad_logits = (grad_logits * (slope * scale)).to(w.dtype)
        else:  # the row scale on the chunk's hidden rows [c, H], not on its logits [c, V]: V / H times less work
            h = (h * scale).to(h.dtype)
        out += grad_logits.t() @ h  # accumulated in `dtype`: the add reads the compute-dtype product directly
    return out


def _weight_gradient_kept(grad_rows: torch.Tensor, hidden: torch.Tensor, kept: torch.Tensor,
                          scored: Optional[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """`_weight_gradient` from the forward's kept d(CE)/d(logits) rows `kept [M, V]`: one matmul over all rows."""
    g = grad_rows if scored is None else grad_rows * scored.to(grad_rows.dtype)
    return (kept.t() @ (hidden * g.unsqueeze(1)).to(hidden.dtype)).to(dtype)


@dataclass
class RowLoss:
    loss: torch.Tensor  # [M] per-row CE (soft when distilling), differentiable w.r.t. hidden
    label_logp: torch.Tensor  # [M] log-probability of the hard label (no gradient)
    correct: torch.Tensor  # [M] bool: argmax == label
    top_values: Optional[torch.Tensor] = None  # [M, k] with top_k: each row's k best logits, best first
    top_ids: Optional[torch.Tensor] = None  # [M, k] their vocabulary ids
    label_logits: Optional[torch.Tensor] = None  # [M] the label's logit


def chunked_ce_rows(hidden: torch.Tensor, lm_head_weight: torch.Tensor, labels: torch.Tensor,
                    how: CEOptions = CEOptions(), target_hidden: Optional[torch.Tensor] = None) -> RowLoss:
    """Per-row CE of `lm_head(hidden) [M, V]` (times `how.output_multiplier`, then softcapped at `how.softcap`)
    against `labels [M]`, mixed with the target's distribution `softmax(lm_head(target_hidden) / temperature)`
    at share `how.distill_weight` (`target_hidden [M, H]`). `how.top_k > 0` also returns each row's k best
    (transformed) scores (read off the same chunks: no second lm_head pass).

    `how.unscored`: labels may be -1, a row whose label is no class of this head (a label outside a reduced draft
    vocabulary): its loss and gradient are 0, it is never correct, its label log-probability is -inf.
    A `lm_head_weight` that requires grad (the drafter's own head) gets its gradient: the backward forms each
    chunk's logits again (two more matmuls per row, with the weight gradient's), or with `how.keep_grad_logits` reads
    the forward's `[M, V]` gradient rows, kept for it in the compute dtype (one matmul; `objective.head_gradient`)."""
    if how.distill_weight > 0 and target_hidden is None:
        raise ValueError("distill_weight > 0 needs target_hidden (the target's final normed hidden state per row)")
    if how.distill_weight == 0:
        target_hidden = None  # alpha = 0 is plain CE: skip the target's logits altogether
    rows, label_logp, correct, top_values, top_ids, label_logits = _ChunkedLinearCE.apply(
        hidden, lm_head_weight, labels, target_hidden, how)
    if not how.top_k:
        return RowLoss(rows, label_logp, correct)
    return RowLoss(rows, label_logp, correct, top_values, top_ids, label_logits)


@dataclass
class LossOutput:
    loss: torch.Tensor  # scalar: sum_i w_i CE_i / sum_i w_i
    correct: torch.Tensor  # [M] bool: argmax == label, per counted row
    weight_sum: torch.Tensor
    weights: torch.Tensor  # [M] the (detached) weights used
    rows: Optional[RowLoss] = None  # the per-row results (top-k candidates among them when asked for)


def chunked_weighted_ce(hidden: torch.Tensor, lm_head_weight: torch.Tensor, labels: torch.Tensor,
                        weights: Union[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]],
                        how: CEOptions = CEOptions(), target_hidden: Optional[torch.Tensor] = None) -> LossOutput:
    """`hidden [M, H]`, `labels [M]` (only rows that count). `weights` is `[M]` (all > 0), or a function of
    the rows' detached label log-probabilities `[M] -> [M]` (weights that depend on the drafter's own
    predictions, from this same forward). Weights never carry gradient. `how` as `chunked_ce_rows` takes it; with
    `how.unscored`, rows labelled -1 (no class) weigh 0, so the loss is normalised over the scored rows alone."""
    out = chunked_ce_rows(hidden, lm_head_weight, labels, how, target_hidden)
    return weighted_rows(out, labels, weights, how.unscored)


def weighted_rows(out: RowLoss, labels: torch.Tensor,
                  weights: Union[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]], unscored: bool) -> LossOutput:
    """`chunked_weighted_ce`'s weighting of per-row results `out` (`chunked_ce_rows`): for callers whose weights
    need more of the forward than the label log-probabilities (pass them as a tensor)."""
    acc_dtype = out.loss.dtype
    w = (weights(out.label_logp) if callable(weights) else weights).detach().to(acc_dtype)
    if unscored:
        w = w * (labels >= 0).to(acc_dtype)
    weight_sum = w.sum()
    norm = w / weight_sum.clamp_min(1e-12)
    return LossOutput((out.loss * norm).sum(), out.correct, weight_sum, w, out)


class _CandidateLogits(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, head, candidates, chunk_size, values):
        acc = torch.promote_types(rows.dtype, torch.float32)
        if values is None:
            values = torch.empty(candidates.shape, device=rows.device, dtype=acc)
            for start, end in chunk_bounds(rows.shape[0], chunk_size):
                values[start:end] = torch.einsum("mh,mkh->mk", rows[start:end],
                                                 head[candidates[start:end]].to(rows.dtype)).to(acc)
        else:
            values = values.to(acc).clone()
        ctx.save_for_backward(head, candidates)
        ctx.chunk_size, ctx.rows_dtype = chunk_size, rows.dtype
        return values

    @staticmethod
    def backward(ctx, grad):
        head, candidates = ctx.saved_tensors
        grad_rows = torch.empty(candidates.shape[0], head.shape[1], device=grad.device, dtype=ctx.rows_dtype)
        for start, end in chunk_bounds(candidates.shape[0], ctx.chunk_size):
            grad_rows[start:end] = torch.einsum("mk,mkh->mh", grad[start:end].to(ctx.rows_dtype),
                                                head[candidates[start:end]].to(ctx.rows_dtype))
        return grad_rows, None, None, None, None


def candidate_logits(rows: torch.Tensor, head: torch.Tensor, candidates: torch.Tensor, chunk_size: int = 2048,
                     values: Optional[torch.Tensor] = None) -> torch.Tensor:
    """`[M, k]` the logits `<rows[m], head[candidates[m, j]]>` (float32 at least) of each row's candidates under a
    frozen head `[V, H]`, with their gradient into `rows [M, H]` (`head[c]`), `chunk_size` rows at a time: the
    gathered head rows `[chunk, k, H]` exist one chunk at a time, in the forward and again in the backward, and no
    `[M, k, H]` gather is kept to the backward. `values`: the logits already known (read off the chunked CE's own
    lm_head pass): returned as they are, the forward computes nothing."""
    if head.requires_grad:
        raise ValueError("candidate_logits differentiates the rows only: the head must be frozen")
    return _CandidateLogits.apply(rows, head, candidates, chunk_size, values)
