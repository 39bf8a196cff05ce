"""The plan's size classes (train/plan/size_classes.py): the extreme batches the warm-up runs are the plan's own,
reach every edge over every epoch, and the block bound is what `sample_anchors` gives."""

import numpy as np
import pytest
import torch

from dflash_train.data.dataset import plan_batches
from dflash_train.train.plan import size_classes
from dflash_train.architectures.family.blocks import sample_anchors


def _lengths(n=600, seed=0):
    return np.random.default_rng(seed).integers(40, 700, n)


@pytest.mark.parametrize("max_batch_anchors", [0, 700])
def test_each_edge_is_a_planned_batch_at_the_extreme_of_all_epochs(max_batch_anchors):
    lengths = _lengths()
    args = (lengths, 4096, 12, 3)
    edges = size_classes.extreme_classes(*args, range(0, 3), 16, 64, max_batch_anchors, 8)
    planned = [(ep, i, tuple(rows)) for ep in range(3) for i, rows in enumerate(plan_batches(*args, ep))]

    def sizes(rows):
        lens = lengths[list(rows)]
        n = int(size_classes.block_bound(np.array([len(rows)]), np.array([lens.max()]), 16, 64,
                                         max_batch_anchors, 8)[0])
        return len(rows), int(lens.max()), n

    every = [sizes(rows) for _, _, rows in planned]
    for edge, key in size_classes.EDGES.items():
        c = edges[edge]
        assert (c.epoch, c.index, c.rows) in planned, edge
        assert key(*sizes(c.rows)) == max(key(*s) for s in every), edge
        assert (len(c.rows), c.context, c.blocks) == sizes(c.rows)
    runs = size_classes.warm_up_batches(edges)
    assert sorted(e for _, names in runs for e in names) == sorted(size_classes.EDGES)
    assert len({rows for rows, _ in runs}) == len(runs)
    first = tuple(plan_batches(*args, 0)[0])
    assert all(rows != first for rows, _ in size_classes.warm_up_batches(edges, skip=first))


def test_later_epochs_count():
    """A run that starts (or resumes) in a later epoch takes that epoch's plan: batches are regrouped each epoch."""
    lengths = _lengths(seed=1)
    args = (lengths, 4096, 12, 3)
    e0 = size_classes.extreme_classes(*args, range(0, 1), 16, 64, 0, 8)
    e5 = size_classes.extreme_classes(*args, range(5, 6), 16, 64, 0, 8)
    assert all(c.epoch == 5 for c in e5.values()) and all(c.epoch == 0 for c in e0.values())


@pytest.mark.parametrize("max_batch_anchors", [0, 300])
def test_the_block_bound_is_what_sample_anchors_gives_rows_supervised_throughout(max_batch_anchors):
    g = torch.Generator().manual_seed(0)
    for rows, longest in ((1, 30), (3, 200), (8, 90), (5, 600)):
        lengths = torch.randint(20, longest + 1, (rows,), generator=g)
        lengths[0] = longest
        mask = torch.ones(rows, longest, dtype=torch.long)
        anchors, _ = sample_anchors(mask, lengths, 16, 64, g, 8, max_batch_anchors)
        bound = size_classes.block_bound(np.array([rows]), np.array([longest]), 16, 64, max_batch_anchors, 8)
        assert anchors.shape[1] == int(bound[0]), (rows, longest)
