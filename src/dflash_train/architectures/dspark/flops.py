"""DSpark's own modules in the step's model FLOPs (train/loop/flops.py, `StepFlops`), from its drafter config, forward +
backward: the target's logits its L1 term reads (forward only, the target is frozen; once per target position the
counted rows read), the Markov head (the bias through the `[V, r]` table over the counted rows, and a gated or rnn
head's projection over the block tokens) and the confidence head over the counted rows. The gradient-free first pass
that forms D-PARD's or acceptance slot weights is a second forward of products already counted: not counted."""

from __future__ import annotations

from dataclasses import dataclass

from ..contract import StepFlops
from ..stats import DraftWork


@dataclass(frozen=True)
class DSparkStepFlops(StepFlops):
    hidden: int  # H
    vocab: int  # V
    rank: int  # r; 0 = no Markov head
    kind: str  # vanilla, gated or rnn
    confidence_width: int  # the confidence head's input width; 0 = no confidence head

    def parts(self, work: DraftWork) -> dict[str, float]:
        h, v, m, t, r = self.hidden, self.vocab, work.counted_rows, work.block_tokens, self.rank
        projection = {"gated": (h + r) * r, "rnn": (2 * r + h) * 3 * r}.get(self.kind, 0)
        return {
            # the target's logits: forward only (frozen), each position once
            "target_logits": 2.0 * work.target_positions * h * v,
            # the bias through the table and its two gradients (the feature's and the table's); the projection's three
            "markov": 3.0 * 2 * (m * r * v + t * projection),
            "confidence": 3.0 * 2 * m * self.confidence_width,
        }


def step_flops(drafter_config) -> DSparkStepFlops:
    h, rank = int(drafter_config.hidden_size), int(drafter_config.markov_rank)
    with_markov = bool(drafter_config.confidence_head_with_markov) and rank > 0
    width = h + (rank if with_markov else 0) if drafter_config.enable_confidence_head else 0
    return DSparkStepFlops(h, int(drafter_config.vocab_size), rank, str(drafter_config.markov_head_type), width)
