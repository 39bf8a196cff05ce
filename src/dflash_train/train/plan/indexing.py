"""How far a run's plan keeps the compiled graphs from 2^31 elements, where inductor's 32-bit indexing ends.

Inductor (GPU) indexes a kernel with 32-bit integers when, at the sizes it compiles for, the kernel's element
count and every buffer it touches fit in 2^31 - 1, and it then guards the dynamic sizes to stay there
(`numel <= 2147483647`); otherwise it indexes with 64-bit integers, which are slower, and installs no guard.
So a plan whose largest tensor in compiled code crosses 2^31 either recompiles when the first batch over it
comes (mid-run, unless the warm-up ran one like it) or runs 64-bit kernels for every batch from then on. A
plan that stays under it never fails such a guard. The start therefore computes, over every planned
micro-batch of the epochs the run reaches, the largest element count of a tensor in the compiled graphs,
says how far it is from 2^31 (log and status.json), and warns about a plan that crosses it, naming what to
lower: the warm-up runs the plan's largest batches, so crossing costs kernel speed, never a mid-run recompile. A batch's block count is what `sample_anchors` gives its rows' anchor positions (supervised
positions a whole block before the row's end; for a prepared dataset its supervised tokens, an upper bound).

The tensors, per micro-batch of b rows, context s (padded to the attention's tiles: s'), n blocks of size bs
(Q = n * bs block slots), as the compiled functions hold them, forward and backward alike:
- the target's layers (`target.compile`): b * s * max(hidden, heads * head dim, intermediate) (its
  projections and MLP activations; keys and values repeated to every head are as large as the queries; the
  attention itself is torch's sdpa kernel, which holds no score matrix);
- the drafter's layers (`drafter.compile`): b * s' * max(hidden, kv heads * head dim) over the context,
  b * Q * max(hidden, heads * head dim, intermediate) over the block;
- flex attention: queries b * Q * heads * head dim, keys and values b * (s' + Q) * kv heads * head dim;
- the loss's chunk (compiled on GPU): min(loss_chunk_size, b * Q) * vocab logits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from ...data.dataset import plan_batches
from ...architectures.family.blocks import blocks_for

INT32_MAX = 2**31 - 1


@dataclass(frozen=True)
class CompiledWidths:
    """Elements per position of the largest tensors of each compiled graph (0: that graph is not compiled)."""

    target: int = 0  # per token of the target's layers
    drafter_context: int = 0  # per context position of the drafter's layers
    drafter_block: int = 0  # per block slot of the drafter's layers
    attention_query: int = 0  # flex attention, per block slot
    attention_key: int = 0  # flex attention, per key (context and block)
    loss_row: int = 0  # the loss chunk, per counted row (the vocabulary)
    loss_chunk: int = 1  # objective.loss_chunk_size
    block_size: int = 1
    context_multiple: int = 1

    def terms(self, b: np.ndarray, s: np.ndarray, n: np.ndarray) -> dict[str, np.ndarray]:
        """Per kind of tensor (named by the config keys that bound it): its element count per batch."""
        padded = -(-s // self.context_multiple) * self.context_multiple
        slots = n * self.block_size
        return {
            "the target's layers (b x s: data.token_budget)": b * s * self.target,
            "the drafter's layers over the context (b x s: data.token_budget)": b * padded * self.drafter_context,
            "the drafter's layers over the blocks (b x blocks: objective.max_anchors, "
            "objective.max_anchors_per_batch, data.max_batch_size)": b * slots * self.drafter_block,
            "flex attention's queries (b x blocks: objective.max_anchors, objective.max_anchors_per_batch, "
            "data.max_batch_size)": b * slots * self.attention_query,
            "flex attention's keys (b x (s + blocks): data.token_budget, objective.max_anchors)":
                b * (padded + slots) * self.attention_key,
            "the loss chunk's logits (rows x vocab: objective.loss_chunk_size)":
                np.minimum(self.loss_chunk, b * slots) * self.loss_row,
        }


def compiled_widths(cfg, drafter_config, target_config, backend, on_gpu: bool) -> CompiledWidths:
    """The widths of what this run compiles: `target.compile`, `drafter.compile`, flex attention and (on a
    GPU) the loss chunk. `drafter_config`: the drafter's; `target_config`: the target's text config."""
    d, t = drafter_config, target_config
    d_head = d.head_dim
    t_head = getattr(t, "head_dim", None) or t.hidden_size // t.num_attention_heads
    t_mlp = getattr(t, "intermediate_size", 0) or 0
    flex = backend.name == "flex"
    return CompiledWidths(
        target=max(t.hidden_size, t.num_attention_heads * t_head, t_mlp) if cfg.target.compile else 0,
        drafter_context=max(d.hidden_size, d.num_key_value_heads * d_head) if cfg.drafter.compile else 0,
        drafter_block=max(d.hidden_size, d.num_attention_heads * d_head, d.intermediate_size)
        if cfg.drafter.compile else 0,
        attention_query=d.num_attention_heads * d_head if flex else 0,
        attention_key=d.num_key_value_heads * d_head if flex else 0,
        loss_row=(cfg.drafter.draft_vocab_size or t.vocab_size) if on_gpu else 0,  # the drafter's vocabulary
        loss_chunk=cfg.objective.loss_chunk_size,
        block_size=d.block_size,
        context_multiple=backend.context_multiple_of,
    )


@dataclass(frozen=True)
class LargestTensor:
    """The largest element count of a tensor in compiled code over the plan, and where it is."""

    elements: int
    what: str  # the kind of tensor (`CompiledWidths.terms`)
    epoch: int
    rows: int
    context: int
    blocks: int

    @property
    def headroom(self) -> float:
        """2^31 - 1 over the largest count (> 1: the plan stays in 32-bit indexing; inf: nothing compiled)."""
        return INT32_MAX / self.elements if self.elements else float("inf")

    def describe(self) -> str:
        if not self.elements:
            return "32-bit indexing: nothing of this run is compiled by inductor"
        return (f"32-bit indexing: the largest tensor in compiled code holds {self.elements:,} elements "
                f"({self.what}; epoch {self.epoch}: {self.rows} rows x {self.context} tokens, {self.blocks} blocks a "
                f"row), {self.headroom:.2f}x below 2^31 - 1")


def largest_tensor(widths: CompiledWidths, lengths: np.ndarray, token_budget: int, max_batch_size: int, seed: int,
                   epochs: range, max_anchors: int, max_batch_anchors: int, multiple_of: int,
                   anchor_positions: Optional[np.ndarray] = None) -> LargestTensor:
    """Over every planned micro-batch of `epochs` (one epoch's plan in memory at a time). A batch's blocks:
    `sample_anchors`'s count for its rows' `anchor_positions` (`TrainingData.anchor_positions`; without them,
    every position of a row counts, `size_classes.block_bound`)."""
    if anchor_positions is None:
        anchor_positions = lengths - widths.block_size + 1
    best = LargestTensor(0, "", 0, 0, 0, 0)
    for epoch in epochs:
        plan = plan_batches(lengths, token_budget, max_batch_size, seed, epoch)
        if not plan:
            continue
        rows = np.array([len(r) for r in plan], dtype=np.int64)
        members = np.concatenate([np.asarray(r, dtype=np.int64) for r in plan])
        starts = np.concatenate([[0], np.cumsum(rows)[:-1]])
        longest = np.maximum.reduceat(lengths[members].astype(np.int64), starts)
        most = np.maximum.reduceat(np.asarray(anchor_positions, dtype=np.int64)[members], starts)
        blocks = blocks_for(rows, most, max_anchors, max_batch_anchors, multiple_of)
        for what, counts in widths.terms(rows, longest, blocks).items():
            i = int(np.argmax(counts))
            if int(counts[i]) > best.elements:
                best = LargestTensor(int(counts[i]), what, epoch, int(rows[i]), int(longest[i]), int(blocks[i]))
    return best


def over_limit_warning(largest: LargestTensor) -> Optional[str]:
    """What to say when the plan's largest compiled tensor crosses 2^31 - 1 elements (None when it does not). Not
    a refusal: the warm-up runs the plan's largest batches, so the 64-bit variant is compiled before the seal
    and no step recompiles; what is lost is the speed of 32-bit kernels on the batches that would fit."""
    if largest.elements <= INT32_MAX:
        return None
    return (f"the plan's largest tensor in compiled code holds {largest.elements:,} elements ({largest.what}; "
            f"epoch {largest.epoch}: {largest.rows} rows x {largest.context} tokens, {largest.blocks} blocks a row), "
            f"over 2^31 - 1 = {INT32_MAX:,}: the warm-up compiles such batches with 64-bit indexing, and the steps "
            f"then run those slower kernels (no recompile). To stay in 32-bit indexing, lower the config keys named "
            f"there by {largest.elements / INT32_MAX:.2f}x or more")
