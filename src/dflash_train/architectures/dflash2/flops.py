"""DFlash2's own modules in the step's model FLOPs (train/loop/flops.py, `StepFlops`), from its drafter config, forward +
backward:

- `convolutions`: each layer's two tap projections (the convolutions before and after its attention and MLP) over
  every query row (`family.conv.conv_flops_per_query`);
- `selector`: over every counted row, the hidden projection (H -> R, with its input gradient: the rows train) and
  the pair scores of the k candidates (R products each, with the gradients of both factors).

The factored codebooks' products from the target's lm_head (`dflash2.selector_codebooks=factored`: 2 V H R forward
and the same again for the weight gradient, per codebook and micro-batch) are not counted."""

from __future__ import annotations

from dataclasses import dataclass

from ..contract import StepFlops
from ..family.conv import conv_flops_per_query
from ..stats import DraftWork


@dataclass(frozen=True)
class DFlash2StepFlops(StepFlops):
    hidden: int  # H
    draft_layers: int
    conv_kernel: int  # K
    conv_group: int  # g
    rank: int  # R
    top_k: int  # k

    def parts(self, work: DraftWork) -> dict[str, float]:
        h, r, k, rows = self.hidden, self.rank, self.top_k, work.counted_rows
        return {
            "convolutions": self.draft_layers * work.block_tokens * conv_flops_per_query(self.conv_kernel,
                                                                                         self.conv_group, h),
            "selector": 3.0 * 2 * rows * r * (h + k),
        }


def step_flops(drafter_config) -> DFlash2StepFlops:
    d = drafter_config.dflash_config
    return DFlash2StepFlops(int(drafter_config.hidden_size), int(drafter_config.num_hidden_layers),
                            int(d["conv_kernel_size"]), int(d["conv_group_size"]), int(d["selector_rank"]),
                            int(d["selector_top_k"]))
