"""The sizes a run's compiled graphs will see, read off the deterministic data plan before training starts.

Dynamo compiles the drafter, its attention and the loss with dynamic sizes, but the graphs it returns can
still hold guards on those sizes (a batch of one row against several; a threshold inductor decided on
from the sizes it first saw). A batch on the other side of such a guard compiles again, mid-run. The
warm-up therefore runs, besides the first batch, the planned micro-batches at the edges of every size the
graphs are built from: most and fewest rows, longest and shortest context, most and fewest tokens, most
blocks a row and most and fewest a micro-batch, over every epoch the run will reach (each epoch's plan depends only on the
seed and the epoch). The compile layer's inductor options remove the thresholds found so far
(`compile.INDUCTOR_OPTIONS`); these batches compile anything left up front, and the loop's recompile check
stops a run that still meets a new size class before it can reach the recompile limit.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...data.dataset import plan_batches
from ...architectures.family.blocks import blocks_for


@dataclass(frozen=True)
class SizeClass:
    """One planned micro-batch and the sizes the compiled graphs see for it (`blocks`: an upper bound of the
    block count, from lengths alone: a row of n tokens has at most n - block_size + 1 anchor positions)."""

    epoch: int
    index: int
    rows: tuple[int, ...]
    context: int  # the longest row: the padded batch length before the context is padded to whole tiles
    blocks: int

    @property
    def tokens(self) -> int:
        return len(self.rows) * self.context

    @property
    def batch_blocks(self) -> int:
        return len(self.rows) * self.blocks


def block_bound(rows: np.ndarray, longest: np.ndarray, block_size: int, max_anchors: int, max_batch_anchors: int,
                multiple_of: int) -> np.ndarray:
    """Per batch (`rows` rows, the longest `longest` tokens): the most blocks `sample_anchors` can give it (the
    per-batch cap and the rounding to `multiple_of` as it applies them; a short batch is padded with not-kept
    blocks up to that count)."""
    return blocks_for(rows, longest - block_size + 1, max_anchors, max_batch_anchors, multiple_of)


# The edges of the plan the warm-up runs: name -> the quantity to maximise.
EDGES = {
    "most rows": lambda b, s, n: b,
    "fewest rows": lambda b, s, n: -b,
    "longest context": lambda b, s, n: s,
    "shortest context": lambda b, s, n: -s,
    "most tokens": lambda b, s, n: b * s,
    "fewest tokens": lambda b, s, n: -(b * s),
    "most blocks a row": lambda b, s, n: n,
    "most blocks a micro-batch": lambda b, s, n: b * n,
    "fewest blocks a micro-batch": lambda b, s, n: -(b * n),
}


def plan_extremes(plan: list[list[int]], lengths: np.ndarray, block_size: int, max_anchors: int,
                  max_batch_anchors: int, multiple_of: int, epoch: int = 0) -> dict[str, tuple[int, SizeClass]]:
    """Per edge of `EDGES`, the value it reaches in `plan` (one epoch's micro-batches, or validation's fixed
    list) and the first batch that reaches it."""
    if not plan:
        return {}
    rows = np.array([len(r) for r in plan], dtype=np.int64)
    flat = lengths[np.concatenate([np.asarray(r, dtype=np.int64) for r in plan])]
    longest = np.maximum.reduceat(flat, np.concatenate([[0], np.cumsum(rows)[:-1]]))
    blocks = block_bound(rows, longest, block_size, max_anchors, max_batch_anchors, multiple_of)
    out = {}
    for edge, key in EDGES.items():
        values = key(rows, longest, blocks)
        i = int(np.argmax(values))  # the first batch at the maximum
        out[edge] = (int(values[i]), SizeClass(epoch, i, tuple(int(r) for r in plan[i]), int(longest[i]),
                                               int(blocks[i])))
    return out


def extreme_classes(lengths: np.ndarray, token_budget: int, max_batch_size: int, seed: int, epochs: range,
                    block_size: int, max_anchors: int, max_batch_anchors: int, multiple_of: int) -> dict[str, SizeClass]:
    """Per edge of `EDGES`, the first planned micro-batch over `epochs` that reaches it (one epoch's plan in
    memory at a time)."""
    best: dict[str, tuple[int, SizeClass]] = {}
    for epoch in epochs:
        plan = plan_batches(lengths, token_budget, max_batch_size, seed, epoch)
        for edge, (value, c) in plan_extremes(plan, lengths, block_size, max_anchors, max_batch_anchors, multiple_of,
                                              epoch).items():
            if edge not in best or value > best[edge][0]:
                best[edge] = (value, c)
    return {edge: c for edge, (_, c) in best.items()}


def warm_up_batches(extremes: dict[str, SizeClass], skip: tuple[int, ...] = ()) -> list[tuple[tuple[int, ...], list[str]]]:
    """The distinct row lists of the extreme batches (one batch may be the extreme of several edges), each
    with the edges it stands for; `skip`: a row list the warm-up runs anyway (its first batch)."""
    chosen: dict[tuple[int, ...], list[str]] = {}
    for edge, c in extremes.items():
        if c.rows != tuple(skip):
            chosen.setdefault(c.rows, []).append(edge)
    return list(chosen.items())


def describe(extremes: dict[str, SizeClass]) -> str:
    e = extremes
    return (f"rows {len(e['fewest rows'].rows)}-{len(e['most rows'].rows)}, context {e['shortest context'].context}-"
            f"{e['longest context'].context} tokens, micro-batch tokens {e['fewest tokens'].tokens}-"
            f"{e['most tokens'].tokens}, up to {e['most blocks a row'].blocks} blocks a row and "
            f"{e['most blocks a micro-batch'].batch_blocks} a micro-batch")
