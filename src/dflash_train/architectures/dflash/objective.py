"""DFlash's objective: the family's slot-weighted cross-entropy of the counted slots (`objective.slot_weighting`),
mixed with the target's distribution at `objective.distill_weight`; with a reduced draft vocabulary, over its
tokens, a label outside it a miss."""

from __future__ import annotations

from typing import Optional

import torch

from ..family.blocks import Blocks
from ..family.objective import BlockObjective, block_stats, ce_text
from ..stats import StepStats


class DFlashObjective(BlockObjective):
    def describe(self) -> str:
        return ce_text(self.cfg)

    def rows_loss(self, rows: torch.Tensor, blocks: Blocks, idx: torch.Tensor,
                  final: Optional[torch.Tensor]) -> StepStats:
        result = self.unary_loss(rows, blocks, idx, final)
        stats = block_stats(result.loss, result.correct, blocks, idx)
        if self.drafter.draft_vocab_size:  # logged as a share of the counted slots
            stats.extra["label_outside_draft_vocab"] = (self.scored_labels(blocks, idx)[0] < 0).sum()
        return stats
