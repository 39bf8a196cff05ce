"""The DFlash2 training objective: DFlash's slot-weighted CE on the unary logits, plus a selector loss.

The selector loss, per counted slot: the k best unary logits of the slot are its candidates (read off the same
lm_head chunks as the unary CE); the slot's label is forced into the set (it replaces the weakest candidate
when missing), the slot's true previous token is the predecessor (teacher forcing: the label of the slot
before, the anchor for slot 1), and the loss is the cross-entropy of `softmax(S)` over the k candidates
against the label, with the unary loss's slot weights (made of the unary probabilities of the labels, or with
`dflash2.acceptance_from=selector` of the selector's, `softmax(S)` at the label):

    loss = CE_unary + selector_loss_weight * sum_rows w_row * CE_k(S_row, label) / sum_rows w_row

With `dflash2.selector_rows=covered` (the default) the sum runs over the rows whose label is among the strict
top-k only (the normaliser stays the sum over all rows); `all` takes every row, the label forced in.

Factored codebooks (`dflash2.selector_codebooks=factored`) are computed from the target's lm_head once per
micro-batch, inside the graph, so the selector loss trains their two projections.

The candidates' unary scores enter S detached: the selector loss trains the codebooks, the hidden projection
and, through the pair term, the drafter's hidden states, but never pushes the unary logits (the unary CE
does that). Metrics count a slot right when the selector, given the true previous token, picks its label
from the strict top-k (what greedy decoding along the right path proposes); the records also carry the unary
argmax's accuracy (`unary_accuracy`, DFlash's `accuracy`), the share of counted slots whose label is among the
candidates (`candidate_coverage`) and `selector_loss`.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from ..family.blocks import Blocks
from ..family.loss import weighted_rows
from ..family.objective import BlockObjective, block_stats, ce_text, row_weights
from ..stats import StepStats
from .options import options_of


def previous_tokens(labels: torch.Tensor) -> torch.Tensor:
    """`[B, N, bs]` same-position labels -> each slot's true previous token (slot k's is slot k-1's label; slot
    0's label is the anchor token, so slot 1's predecessor is the anchor)."""
    return torch.cat([labels[..., :1], labels[..., :-1]], dim=-1)


def forced_candidates(top_values: torch.Tensor, top_ids: torch.Tensor, labels: torch.Tensor,
                      label_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(unary scores `[M, k]`, candidate ids `[M, k]` with the label forced in, the label's index `[M]`, whether the
    label was among the strict top-k `[M]`). A missing label replaces the last (weakest) candidate."""
    hit = top_ids == labels.unsqueeze(1)
    present = hit.any(-1)
    last = top_ids.shape[1] - 1
    ids = top_ids.clone()
    values = top_values.clone()
    ids[:, last] = torch.where(present, ids[:, last], labels)
    values[:, last] = torch.where(present, values[:, last], label_logits.to(values.dtype))
    target = (ids == labels.unsqueeze(1)).to(torch.int8).argmax(-1)
    return values, ids, target, present


class DFlash2Objective(BlockObjective):
    def describe(self) -> str:
        own = options_of(self.cfg)
        return (f"{ce_text(self.cfg)}; + {own.selector_loss_weight:g} x the selector's cross-entropy over its top "
                f"{self.drafter.selector_top_k} candidates")

    def rows_loss(self, rows: torch.Tensor, blocks: Blocks, idx: torch.Tensor,
                  final: Optional[torch.Tensor]) -> StepStats:
        selector, own = self.drafter.candidate_selector, options_of(self.cfg)
        r, head_labels, unscored = self.unary_rows(rows, blocks, idx, final, top_k=self.drafter.selector_top_k)
        labels = blocks.labels.view(-1).index_select(0, idx)
        unary, cand, target, present = forced_candidates(r.top_values, r.top_ids, labels, r.label_logits)
        previous = previous_tokens(blocks.labels).view(-1).index_select(0, idx)
        codebooks = selector.codebooks(self.target.lm_head.weight if selector.factored else None)
        scores = selector.scores(unary.detach(), rows, previous, cand, codebooks)  # [M, k] float32
        selector_ce = F.cross_entropy(scores, target, reduction="none")
        weights = row_weights(self.cfg, blocks, idx)
        if own.acceptance_from == "selector":
            weights = weights(-selector_ce.detach())  # the selector's log-probability of each label
        result = weighted_rows(r, head_labels, weights, unscored)
        norm = result.weights / result.weight_sum.clamp_min(1e-12)
        if own.selector_rows == "covered":  # no loss where the top-k misses the label
            selector_ce = torch.where(present, selector_ce, torch.zeros_like(selector_ce))
        selector_loss = (selector_ce * norm.to(selector_ce.dtype)).sum()
        loss = result.loss + own.selector_loss_weight * selector_loss
        correct = (scores.argmax(-1) == target) & present
        stats = block_stats(loss, correct, blocks, idx)
        # beside the selector's hits (`accuracy`): the unary argmax's (DFlash's accuracy, comparable across
        # architectures), how often the label is among the candidates at all, and the selector's loss
        stats.extra = {"unary_accuracy": result.correct.sum(), "candidate_coverage": present.sum(),
                       "selector_loss": selector_loss.detach()}
        return stats
