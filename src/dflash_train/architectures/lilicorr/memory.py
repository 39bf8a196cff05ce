"""LiLiCorr's terms in the drafter step's activation estimate (train/plan/activation_memory.py, `StepMemory`), beside
DFlash's and the target's final states that `needs_target_final` counts: each lattice node's log-probability, target
logit and scores kept to the backward, and on top of everything else one chunk of the head's activations over the
lattice (the head is checkpointed chunk by chunk); with `lilicorr.conv`, the layers' block convolutions. The target
head's rows at the candidates are gathered one loss chunk of rows at a time (`family.loss.candidate_logits`), in the
backward and for the target's logits, never for every row at once: a transient far below the lattice chunk's."""

from __future__ import annotations

from dataclasses import dataclass

from ..contract import StepMemory
from ..family.conv import conv_values_per_query, has_conv_layers
from .config import head_fields
from .head import chunk_blocks

_F32 = 4


@dataclass(frozen=True)
class LiLiCorrStepMemory(StepMemory):
    hidden: int  # H
    width: int  # h
    layers: int
    mlp_ratio: float
    factor_dim: int  # f
    topk: int  # k
    heads: int
    block_size: int
    conv_kernel: int = 0  # the layers' block convolutions' taps (lilicorr.conv), 0 without them

    def layer_per_query(self, hidden: int) -> int:
        """With `lilicorr.conv`, the four block convolutions of each layer (`family.conv.conv_values_per_query`)."""
        return conv_values_per_query(self.conv_kernel, hidden) if self.conv_kernel else 0

    def values_per_node(self) -> int:
        """Values one lattice node keeps to the backward: its embedding and head row (H each), the input sum and its
        projections (~6 h), each layer's norms, packed q/k/v and their per-head copies, attention output and MLP
        (~(10 + 3 ratio) h), the factor input (3 h), its output and the three factor vectors (~h + 3 f)."""
        h = self.width
        per_layer = int((10 + 3 * self.mlp_ratio) * h)
        return 2 * self.hidden + 6 * h + self.layers * per_layer + 4 * h + 3 * self.factor_dim

    def attention_per_block(self) -> int:
        """Values each layer's attention keeps per block (eager: the biased scores and their softmax, per head, over
        the block's (B - 1) k nodes)."""
        nodes = (self.block_size - 1) * self.topk
        return self.layers * 2 * self.heads * nodes * nodes

    def lattice_chunk(self, counted: int) -> int:
        """One chunk of the head (the run's `head.chunk_blocks`, whole blocks of (B - 1) k nodes), recomputed in the
        backward: its saved activations at float32 (the widest compute dtype), which the backward frees layer by
        layer as their gradients form (measured on the CPU, float32 and bfloat16 autocast: at most this). The run's
        largest micro-batch sets the chunk; each micro-batch counted here stands for that one. A compiled head pads a
        step's last chunk to a whole one; a step with fewer nodes than one chunk is counted at its own size (the
        largest micro-batches, which the preflight checks, fill chunks)."""
        per_block = (self.block_size - 1) * self.topk
        blocks = -(-counted * self.topk // per_block)
        chunk = min(blocks, chunk_blocks(blocks, self.block_size - 1, self.topk))
        return (chunk * per_block * self.values_per_node() + chunk * self.attention_per_block()) * _F32

    def on_top(self, counted: int, head_classes: int, e: int) -> dict[str, int]:
        """The head's chunk: its backward runs first, before the CE chunks' and the layers' (and no two of these
        at once), on top of every layer's saved activations."""
        return {"lilicorr lattice chunk": self.lattice_chunk(counted)}

    def loss_rows(self, counted: int, e: int) -> int:
        """Each of the lattice's nodes (k per counted row) keeps its log-probability, target logit and scores
        (~3 k + 8 float32 a row)."""
        return counted * self.topk * (3 * self.topk + 8) * _F32


def step_memory(drafter_config) -> LiLiCorrStepMemory:
    d = drafter_config.dflash_config
    f = head_fields(d)
    h = int(drafter_config.hidden_size)
    return LiLiCorrStepMemory(h, f["lilicorr_hidden_size"] or h, f["lilicorr_num_layers"], f["lilicorr_mlp_ratio"],
                              f["lilicorr_factor_dim"], f["lilicorr_candidate_topk"], f["lilicorr_num_heads"],
                              int(drafter_config.block_size),
                              int(d["conv_kernel_size"]) if has_conv_layers(d) else 0)
