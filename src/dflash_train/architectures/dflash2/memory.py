"""DFlash2's terms in the drafter step's activation estimate (train/plan/activation_memory.py, `StepMemory`), from its
drafter config: the block convolutions' saved inputs, the selector's top-k and codebook gathers."""

from __future__ import annotations

from dataclasses import dataclass

from ..contract import StepMemory
from ..family.conv import conv_values_per_query

_F32 = 4


@dataclass(frozen=True)
class DFlash2StepMemory(StepMemory):
    top_k: int  # the selector's candidates per slot
    rank: int  # the selector's rank
    conv_kernel: int  # the block convolutions' taps
    factored: bool  # the selector's [vocab, rank] codebooks computed every micro-batch

    def ce_chunk_per_class(self, e: int, compiled: bool) -> int:
        """The top-k of each chunk: a padded copy of the logits and the gathered groups."""
        return 2 * e

    def layer_per_query(self, hidden: int) -> int:
        """The four block convolutions (`family.conv.conv_values_per_query`)."""
        return conv_values_per_query(self.conv_kernel, hidden)

    def on_top(self, counted: int, head_classes: int, e: int) -> dict[str, int]:
        """The selector: its top-k candidates and `[counted, k, rank]` codebook gathers (forward and gradient);
        factored codebooks add both tables, their float32 copies and gradients."""
        selector = counted * self.top_k * (2 * self.rank * _F32 + 3 * _F32 + 8) + counted * 4 * self.rank * _F32
        if self.factored:
            selector += 2 * head_classes * self.rank * (e + 2 * _F32)
        return {"selector": selector}

    def loss_rows(self, counted: int, e: int) -> int:
        """Each counted row's top-k values and ids."""
        return counted * self.top_k * (_F32 + 8)


def step_memory(drafter_config) -> DFlash2StepMemory:
    d = drafter_config.dflash_config
    return DFlash2StepMemory(int(d["selector_top_k"]), int(d["selector_rank"]), int(d["conv_kernel_size"]),
                             d.get("selector_codebooks") == "factored")
