"""DFlash2 in the on-policy stage: Draft-OPD (`family/onpolicy.py`) on the distribution DFlash2's greedy walk takes
the argmax of. At slot t after the committed token a, with unary logits U and the selector's scores S over the top-k
candidates C of U:

    q(x) = softmax(U)(x)                               for x outside C
    q(x) = softmax(S)(x) * sum_{c in C} softmax(U)(c)  for x in C

the candidates share the unary mass they hold, as the selector redistributes it given a (the tree's scoring too).
Its argmax is the walk's pick (no outside token outweighs the best candidate's share), and with S = U it is
DFlash's softmax. The gradient reaches the unary logits, the selector and the hidden states alike."""

from __future__ import annotations

from typing import Optional

import torch

from ..family.blocks import Blocks
from ..family.loss import CEOptions, candidate_logits, chunked_ce_rows
from ..family.onpolicy import DraftLogProbs, OnPolicyObjective, wide
from .objective import previous_tokens


class DFlash2OnPolicyObjective(OnPolicyObjective):
    def draft_log_probs(self, rows: torch.Tensor, blocks: Blocks, idx: torch.Tensor, labels: torch.Tensor,
                        rej: torch.Tensor, drafts: torch.Tensor, out: Optional[torch.Tensor] = None) -> DraftLogProbs:
        head, selector = self.target.lm_head.weight, self.drafter.candidate_selector
        k = min(self.drafter.selector_top_k, head.shape[0])
        chunk = self.cfg.objective.loss_chunk_size
        res = chunked_ce_rows(rows, head, labels, CEOptions(chunk, top_k=k))
        candidates = res.top_ids  # [M, k]
        # the logits are the chunked pass's own; `candidate_logits` adds their gradient (the head's rows)
        z = candidate_logits(rows, head, candidates, chunk, values=res.top_values)
        log_unary = wide(-res.loss)  # log softmax(U) at the label
        label_logit = candidate_logits(rows, head, labels.view(-1, 1), chunk, values=res.label_logits.view(-1, 1))
        log_norm = label_logit.squeeze(1) - log_unary  # log sum exp U
        mass = z.logsumexp(-1) - log_norm  # log of the unary probability the candidates hold
        previous = previous_tokens(blocks.labels).view(-1).index_select(0, idx)
        codebooks = selector.codebooks(head if selector.factored else None)
        log_s = torch.log_softmax(selector.scores(z, rows, previous, candidates, codebooks), -1)  # [M, k]
        hit = candidates == labels.unsqueeze(1)
        label = torch.where(hit.any(-1), (log_s * hit).sum(-1) + mass, log_unary)
        # the rollout's draft: a candidate (the selector's pick) whose rescored mass is q, else its unary probability
        drafted = candidates.index_select(0, rej) == drafts.unsqueeze(1)
        log_unary_draft = candidate_logits(rows.index_select(0, rej), head, drafts.view(-1, 1), chunk).squeeze(1) \
            - log_norm.index_select(0, rej)
        draft = torch.where(drafted.any(-1), (log_s.index_select(0, rej) * drafted).sum(-1) + mass.index_select(0, rej),
                            log_unary_draft)
        best = candidates.gather(1, log_s.argmax(-1, keepdim=True)).squeeze(1)
        return DraftLogProbs(label, draft, best == labels)
