"""LiLiCorr's own work in the step's model FLOPs (train/loop/flops.py, `StepFlops`), forward + backward, from its
drafter config. The lattice is counted over every counted row (k nodes each; its blocks, counted rows / (B - 1)):
exact when every kept block's drafted slots all count, an upper bound otherwise (a block with an uncounted slot forms
none).

- `lilicorr_candidates`: the input gradients of the candidates' logits and the label's for the log-probabilities
  (their values are the chunked CE's own: `family.loss.candidate_logits` computes no forward), and the target's
  logits at the candidates (forward only: the target is frozen);
- `lilicorr_anchor_rows`: `fc` over each kept block's anchor row (its weight gradient; the target's features need
  none);
- `lilicorr_head`: the head's projections, layers (their attention over each block's nodes), factor heads and
  scores; the token projection reads detached embeddings (no input gradient);
- `lilicorr_conv` (with `lilicorr.conv`): the layers' convolution tap projections over every query row.

With `lilicorr.backbone_gradient=false` (a training option the drafter config does not hold) the candidates' input
gradients, the anchor rows' weight gradient and the head's input gradients are still counted though not computed: an
upper bound by those few products."""

from __future__ import annotations

from dataclasses import dataclass

from ..contract import StepFlops
from ..family.conv import conv_flops_per_query, has_conv_layers
from ..stats import DraftWork
from .config import head_fields


@dataclass(frozen=True)
class LiLiCorrStepFlops(StepFlops):
    hidden: int  # H
    features: int  # K * H: the captured target layers' features
    width: int  # h
    layers: int
    inner: int  # the layers' MLP width
    factor_dim: int  # f
    topk: int  # k
    block_size: int
    draft_layers: int = 0
    conv: tuple[int, int] = (0, 0)  # the layers' convolutions' (kernel, group size); (0, 0) without them

    def parts(self, work: DraftWork) -> dict[str, float]:
        big, h, f, k, slots = self.hidden, self.width, self.factor_dim, self.topk, self.block_size - 1
        rows = work.counted_rows
        nodes, blocks = rows * k, rows // slots
        token = 4 * nodes * big * h if h != big else 0
        per_node = 5 * h + h * h + 3 * h * h + 2 * h * f + self.layers * (4 * h * h + 2 * h * self.inner)
        attention = self.layers * 4 * blocks * (slots * k) ** 2 * h
        per_block = big * h + h * f + k * f + (slots - 1) * k * k * f
        parts = {
            "lilicorr_candidates": 2.0 * rows * k * big + 2.0 * rows * big + 2.0 * rows * k * big,
            "lilicorr_anchor_rows": 4.0 * work.blocks * self.features * big,
            "lilicorr_head": token + 3.0 * (2 * nodes * per_node + attention + 2 * rows * big * h
                                            + 2 * blocks * per_block),
        }
        if self.conv[0]:
            parts["lilicorr_conv"] = self.draft_layers * work.block_tokens * conv_flops_per_query(*self.conv, big)
        return parts


def step_flops(drafter_config) -> LiLiCorrStepFlops:
    d = drafter_config.dflash_config
    f = head_fields(d)
    big = int(drafter_config.hidden_size)
    width = f["lilicorr_hidden_size"] or big
    features = len(d["target_layer_ids"]) * big
    conv = (int(d["conv_kernel_size"]), int(d["conv_group_size"])) if has_conv_layers(d) else (0, 0)
    return LiLiCorrStepFlops(big, features, width, f["lilicorr_num_layers"], int(width * f["lilicorr_mlp_ratio"]),
                             f["lilicorr_factor_dim"], f["lilicorr_candidate_topk"], int(drafter_config.block_size),
                             int(drafter_config.num_hidden_layers), conv)
