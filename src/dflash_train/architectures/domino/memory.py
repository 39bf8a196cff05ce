"""Domino's terms in the drafter step's activation estimate (train/plan/activation_memory.py, `StepMemory`): the chunk's
second logits (the correction's) and gradient, the GRU's saved states, the projector's rows and the correction's
output weight with its float32 gradient."""

from __future__ import annotations

from dataclasses import dataclass

from ..contract import StepMemory

_F32 = 4


@dataclass(frozen=True)
class DominoStepMemory(StepMemory):
    hidden: int  # H
    gru: int  # G
    emb: int  # E
    block_size: int
    vocab: int  # V (the correction's output rows)

    def ce_chunk_per_class(self, e: int, compiled: bool) -> int:
        """The correction's logits and their gradient beside the base's, and the previous chunk's; eager, the float32
        copies of both terms' probabilities and gradients too. This also bounds the gradient-free pass that makes
        acceptance or dpace slot weights before the loss (`loss.final_label_logp`): it runs alone, before the loss's
        gradient rows exist, and holds one chunk's base and correction logits (and the previous chunk's) with,
        eager, the float32 copies of one term's scores, fewer than the loss's chunk; it keeps one float32 a row."""
        return 3 * e if compiled else 2 * e + 5 * _F32

    def on_top(self, counted: int, head_classes: int, e: int) -> dict[str, int]:
        """The GRU's inputs, states and gates over every block slot (at most `counted * block_size` of them,
        float32); the projector's inputs and bottleneck of the counted rows."""
        gru = counted * self.block_size * (self.hidden * e + 5 * self.gru * _F32)
        rows = counted * ((self.hidden + self.gru) * (e + _F32) + 3 * self.emb * _F32)
        return {"domino_correction": gru + rows}

    def loss_rows(self, counted: int, e: int) -> int:
        """The bottleneck's gradient rows `[M, E]` beside the hidden states' (float32), and the correction's output
        weight `[V, E]` in the compute dtype with its float32 gradient, which the loss keeps to the backward."""
        return counted * self.emb * _F32 + self.vocab * self.emb * 2 * _F32


def step_memory(drafter_config) -> DominoStepMemory:
    d = drafter_config.dflash_config
    return DominoStepMemory(int(drafter_config.hidden_size), int(d["gru_hidden_dim"]), int(d["emb_dim"]),
                            int(drafter_config.block_size), int(drafter_config.vocab_size))
