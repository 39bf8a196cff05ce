"""DSpark's terms in the drafter step's activation estimate (train/plan/activation_memory.py, `StepMemory`), beside
DFlash's and the target distribution that `needs_target_final` already counts there (the target's logits and
softmax in each lm_head chunk, which also covers the sign of p - p_t and D-PARD's geometric mean, formed in
place): the Markov head's activations over the block
slots, the rows the loss keeps until the backward (the target's final states picked for the counted rows, the
Markov features, the confidence head's inputs), the Markov table's gradient the chunked loss forms and the joint
head `[V, H + r]` its product reads."""

from __future__ import annotations

from dataclasses import dataclass

from ..contract import StepMemory

_F32 = 4


@dataclass(frozen=True)
class DSparkStepMemory(StepMemory):
    hidden: int  # H
    vocab: int  # V (the Markov tables' rows)
    rank: int  # r; 0 = no Markov head
    kind: str  # vanilla, gated or rnn
    confidence: bool
    block_size: int

    def markov_values_per_slot(self) -> int:
        """Values (compute dtype) the Markov head keeps for its backward per block slot."""
        r, h = self.rank, self.hidden
        if not r:
            return 0
        if self.kind == "vanilla":
            return r  # the previous token's embedding
        if self.kind == "gated":
            return (h + r) + 2 * r  # the gate's input, its output and the gated feature
        return (2 * r + h) + 3 * r + 4 * r  # the joint input, its output, the gates and the next state

    def head_columns(self) -> int:
        """The Markov table beside the lm_head in the loss's joint product `[h ; f] [W ; W2]^T`."""
        return self.rank

    def loss_rows(self, counted: int, e: int) -> int:
        """Over the block slots of the counted rows (at most `counted * block_size`) the Markov activations; per
        counted row the target's final state (at most one a row: rows share them), the Markov feature and embedding
        picked for it, their gradient and
        the confidence head's input (bytes at the widest compute dtype, float32); the Markov table's float32
        gradient `[V, r]`. Whatever the compute dtype `e`."""
        slots = counted * self.block_size
        per_row = self.hidden + 3 * self.rank + ((self.hidden + self.rank) if self.confidence else 0)
        table = self.vocab * self.rank * _F32
        return slots * self.markov_values_per_slot() * _F32 + counted * per_row * _F32 + table


def step_memory(drafter_config) -> DSparkStepMemory:
    return DSparkStepMemory(int(drafter_config.hidden_size), int(drafter_config.vocab_size),
                            int(drafter_config.markov_rank), str(drafter_config.markov_head_type),
                            bool(drafter_config.enable_confidence_head), int(drafter_config.block_size))
