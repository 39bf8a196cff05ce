"""Domino's terms in the drafter step's activation estimate (train/activation_memory.py, `StepMemory`): the second
lm_head + CE pass, the joint head weight, the GRU's saved states and the projector's rows."""

from __future__ import annotations

from dataclasses import dataclass

from ..base import StepMemory

_F32 = 4


@dataclass(frozen=True)
class DominoStepMemory(StepMemory):
    hidden: int  # H
    gru: int  # G
    emb: int  # E
    block_size: int

    def on_top(self, counted: int, head_classes: int, e: int) -> dict[str, int]:
        """The joint head `[V, H + E]` (compute dtype) and its float32 gradient, formed for the corrected scores;
        the GRU's inputs, states and gates over every block slot (at most `counted * block_size` of them, float32);
        the projector's inputs, bottleneck and the joint rows of the counted rows."""
        head = head_classes * (self.hidden + self.emb) * (e + _F32)
        gru = counted * self.block_size * (self.hidden * e + 5 * self.gru * _F32)
        rows = counted * ((self.hidden + self.gru) * (e + _F32) + 3 * self.emb * _F32 + (self.hidden + self.emb) * e)
        return {"domino_correction": head + gru + rows}

    def loss_rows(self, counted: int) -> int:
        """The base CE's gradient rows kept next to the final CE's (`[M, H]`, float32)."""
        return counted * self.hidden * _F32


def step_memory(drafter_config) -> DominoStepMemory:
    d = drafter_config.dflash_config
    return DominoStepMemory(int(drafter_config.hidden_size), int(d["gru_hidden_dim"]), int(d["emb_dim"]),
                            int(drafter_config.block_size))
