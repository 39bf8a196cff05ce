"""LiLiCorr in the on-policy stage: Draft-OPD (`family/onpolicy.py`) on the distribution LiLiCorr's greedy lattice walk
takes the argmax of. Drafted slot s's k candidates are the top-k of its logits; given the committed token before it,
q is `softmax` of the head's row leaving that token's candidate (`log_start` at the first drafted slot), over the k
candidates, zero for every other token (as the engines sample it). A committed token outside the candidates (the
target's correction of a slot whose candidates missed it) has q = 0: its term is clamped at `onpolicy.log_prob_min`
and carries no gradient. The head reads whole blocks, so the stage runs the drafter on every slot of the chain's
blocks; the candidates' log-probabilities keep their gradient into the backbone, as in training."""

from __future__ import annotations

from functools import cached_property
from typing import Optional

import torch

from ..family.blocks import Blocks
from ..family.loss import CEOptions, candidate_logits, chunked_ce_rows
from ..family.onpolicy import DraftLogProbs, OnPolicyObjective, wide
from .objective import lattice_chunk


class LiLiCorrOnPolicyObjective(OnPolicyObjective):
    whole_blocks = True

    @cached_property
    def lattice_chunk(self) -> int:
        return lattice_chunk(self, self.cfg.onpolicy.max_blocks or self.cfg.objective.max_anchors)

    def candidate_log_probs(self, hidden: torch.Tensor, head: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each drafted slot's k best tokens `[n, S, k]` (ids) and their log-probabilities over the full vocabulary
        (with gradient), from the slots' outputs `hidden [n, S, H]`, chunked over the vocabulary."""
        n, slots, width = hidden.shape
        flat = hidden.reshape(-1, width)
        anchor_token = torch.zeros(flat.shape[0], dtype=torch.long, device=flat.device)  # any class: lse is CE + z
        chunk = self.cfg.objective.loss_chunk_size
        res = chunked_ce_rows(flat, head, anchor_token, CEOptions(chunk, top_k=self.drafter.topk))
        # the logits are the chunked pass's own; `candidate_logits` adds their gradient (the head's rows)
        z = candidate_logits(flat, head, res.top_ids, chunk, values=res.top_values)
        log_norm = wide(res.loss) + candidate_logits(flat, head, anchor_token.view(-1, 1), chunk,
                                                     values=res.label_logits.view(-1, 1)).squeeze(1)
        return (z - log_norm.unsqueeze(1)).view(n, slots, -1), res.top_ids.view(n, slots, -1)

    def draft_log_probs(self, rows: torch.Tensor, blocks: Blocks, idx: torch.Tensor, labels: torch.Tensor,
                        rej: torch.Tensor, drafts: torch.Tensor, out: Optional[torch.Tensor] = None) -> DraftLogProbs:
        b, n, bs = blocks.counted.shape
        hidden = out.view(b * n, bs, -1)
        lp, cand = self.candidate_log_probs(hidden[:, 1:], self.target.lm_head.weight)
        log_start, log_pair = self.drafter.lattice(hidden, lp, cand, self.target.embed_tokens, self.lattice_chunk)
        k = cand.shape[-1]
        # each drafted slot's rows by the predecessor's rank: log_start for the first draft, whatever came before
        rows_by_slot = torch.cat([log_start[:, None, None].expand(-1, 1, k, -1), log_pair], 1)  # [n, S, k, k]
        block, slot = idx // bs, idx % bs - 1  # each counted row's block and drafted slot (0: the first draft)
        previous = blocks.labels.view(b * n, bs)[block, slot]  # the committed token before it (the anchor at 0)
        previous_hit = cand[block, (slot - 1).clamp_min(0)] == previous.unsqueeze(1)
        logq = torch.log_softmax(rows_by_slot[block, slot, previous_hit.long().argmax(-1)], -1)  # [M, k]
        on_lattice = (slot == 0) | previous_hit.any(-1)
        hit = (cand[block, slot] == labels.unsqueeze(1)) & on_lattice.unsqueeze(1)
        outside = torch.full_like(logq[:, 0], self.cfg.onpolicy.log_prob_min)
        label = torch.where(hit.any(-1), (logq * hit).sum(-1), outside)
        # the rollout's draft, on the lattice (a candidate of its slot after the committed token) or q = 0
        on = on_lattice.index_select(0, rej).unsqueeze(1)
        drafted = (cand[block, slot].index_select(0, rej) == drafts.unsqueeze(1)) & on
        draft = torch.where(drafted.any(-1), (logq.index_select(0, rej) * drafted).sum(-1),
                            outside.index_select(0, rej))
        best = cand[block, slot].gather(1, logq.argmax(-1, keepdim=True)).squeeze(1)
        return DraftLogProbs(label, draft, (best == labels) & on_lattice)
