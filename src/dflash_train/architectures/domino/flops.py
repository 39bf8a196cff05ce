"""Domino's own modules in the step's model FLOPs (train/loop/flops.py, `StepFlops`), from its drafter config, forward +
backward: the GRU over the block tokens (the target's embeddings it reads need no gradient) and the correction over
the counted rows (the bottleneck and the `[V, E]` projection; the pure-draft slots' included: they are formed, then
zeroed). The gradient-free pass that forms acceptance or dpace slot weights is a second forward of products already
counted: not counted."""

from __future__ import annotations

from dataclasses import dataclass

from ..contract import StepFlops
from ..stats import DraftWork


@dataclass(frozen=True)
class DominoStepFlops(StepFlops):
    hidden: int  # H
    vocab: int  # V
    gru: int  # G
    emb: int  # E

    def parts(self, work: DraftWork) -> dict[str, float]:
        h, v, m, t, g, e = self.hidden, self.vocab, work.counted_rows, work.block_tokens, self.gru, self.emb
        return {
            # input projection forward and its weight gradient; recurrent product forward, state and weight gradients
            "gru": 2.0 * t * 3 * g * (2 * h + 3 * g),
            "correction": 3.0 * 2 * m * e * (h + g + v),
        }


def step_flops(drafter_config) -> DominoStepFlops:
    d = drafter_config.dflash_config
    return DominoStepFlops(int(drafter_config.hidden_size), int(drafter_config.vocab_size), int(d["gru_hidden_dim"]),
                           int(d["emb_dim"]))
