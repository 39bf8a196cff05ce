"""Domino in the on-policy stage: Draft-OPD (`family/onpolicy.py`) in its shifted layout (slot n drafts the token at
`a + n + 1`), on the distribution its decoding takes the argmax of: slot n's corrected scores, `lm_head(z_n)` plus,
from slot `pure_draft_prefix_len` on, `embed_proj([z_n ; g_n])` with `g_n` the GRU's state after the committed tokens
`a .. a + n` (teacher-forced on the data, which decoding commits). Both terms are one softmax over the target's
vocabulary: the hidden state and the correction's bottleneck side by side against the lm_head and the correction's
output matrix side by side, so the chunked cross-entropy trains the correction too."""

from __future__ import annotations

from typing import Optional

import torch

from ..family.blocks import Blocks
from ..family.onpolicy import DraftLogProbs, OnPolicyObjective, softmax_log_probs
from .objective import DominoObjective


class DominoOnPolicyObjective(OnPolicyObjective):
    first_draft_slot = 0
    build_blocks = DominoObjective.build_blocks
    prefix_rows = DominoObjective.prefix_rows

    def draft_log_probs(self, rows: torch.Tensor, blocks: Blocks, idx: torch.Tensor, labels: torch.Tensor,
                        rej: torch.Tensor, drafts: torch.Tensor, out: Optional[torch.Tensor] = None) -> DraftLogProbs:
        d, head = self.drafter, self.target.lm_head.weight
        corrected = (idx % d.block_size >= d.pure_draft_prefix_len).unsqueeze(1)
        features = d.correction_features(rows, self.prefix_rows(blocks, idx))
        features = torch.where(corrected, features, torch.zeros_like(features)).to(rows.dtype)
        weight = torch.cat([head, d.embed_proj[2].weight.to(head.dtype)], 1)
        return softmax_log_probs(torch.cat([rows, features], 1), weight, labels, rej, drafts,
                                 self.cfg.objective.loss_chunk_size)
