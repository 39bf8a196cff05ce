"""How often each target token is a training label, and the reduced draft vocabulary chosen from it.

The labels are the supervised (response) tokens: every token with `loss_mask == 1`, which is what the drafter's
slots predict. `prepare` counts the train split once and stores the counts beside the shards
(`label_counts.npy`, int64, one entry per token id); a run with `drafter.draft_vocab_size: N` takes the N most
frequent tokens from them, ties broken by the lower token id, so the same data always gives the same vocabulary.
The whole count vector is kept, so any N can be chosen later without reading the shards again.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Iterable

import numpy as np

from ..errors import DamagedFileError

from .chat import Tokenized

COUNTS_FILE = "label_counts.npy"


class LabelCounter:
    """Counts the supervised token ids of the examples it is given. Ids are buffered and counted a batch at a
    time (`np.bincount` over a whole vocabulary per row would cost more than the row)."""

    def __init__(self, size: int, flush_tokens: int = 1 << 20):
        self.counts = np.zeros(max(int(size), 0), dtype=np.int64)
        self._pending: list[np.ndarray] = []
        self._buffered = 0
        self._flush_tokens = flush_tokens

    def add(self, ex: Tokenized) -> None:
        labels = ex.input_ids[ex.loss_mask > 0]
        self._pending.append(labels)
        self._buffered += len(labels)
        if self._buffered >= self._flush_tokens:
            self._flush()

    def _flush(self) -> None:
        if not self._pending:
            return
        ids = np.concatenate(self._pending).astype(np.int64, copy=False)
        self._pending, self._buffered = [], 0
        if len(ids) and int(ids.min()) < 0:
            raise ValueError(f"negative token id {int(ids.min())} among the labels")
        counted = np.bincount(ids, minlength=len(self.counts))
        if len(counted) > len(self.counts):  # an id past the tokenizer's length (a model with a padded vocabulary)
            counted[: len(self.counts)] += self.counts
            self.counts = counted.astype(np.int64)
        else:
            self.counts += counted

    def result(self) -> np.ndarray:
        self._flush()
        return self.counts


def count_labels(examples: Iterable[Tokenized], size: int) -> np.ndarray:
    counter = LabelCounter(size)
    for ex in examples:
        counter.add(ex)
    return counter.result()


def write_counts(path: Path, counts: np.ndarray) -> None:
    """The counts as a .npy file (the same counts give the same bytes)."""
    buf = io.BytesIO()
    np.save(buf, np.ascontiguousarray(counts, dtype=np.int64), allow_pickle=False)
    path.write_bytes(buf.getvalue())


def read_counts(path: Path) -> np.ndarray:
    try:
        counts = np.load(path, allow_pickle=False)
    except (ValueError, EOFError) as e:  # a cut or garbled .npy: its header or data does not add up
        raise DamagedFileError(path, f"not a readable .npy file: {e}",
                               "re-run `dflash-train prepare` to re-create the dataset") from None
    if counts.ndim != 1 or counts.dtype != np.int64 or (len(counts) and int(counts.min()) < 0):
        raise ValueError(f"{path} is not a label count vector (1-D, int64, >= 0): shape {counts.shape}, "
                         f"dtype {counts.dtype}; re-run `dflash-train prepare`")
    return counts


def padded(counts: np.ndarray, vocab_size: int, where: str) -> np.ndarray:
    """`counts` as a vector of the target's vocabulary size (ids the data never holds count 0)."""
    if len(counts) > vocab_size and int(counts[vocab_size:].sum()):
        raise ValueError(f"{where}: the labels hold token ids up to {int(np.flatnonzero(counts).max())}, outside the "
                         f"target's vocabulary of {vocab_size}: the data was tokenised for another target")
    out = np.zeros(vocab_size, dtype=np.int64)
    n = min(len(counts), vocab_size)
    out[:n] = counts[:n]
    return out


def draft_vocabulary(counts: np.ndarray, size: int) -> np.ndarray:
    """The `size` most frequent token ids (ties: the lower id first), in ascending id order: draft id i is the
    i-th smallest of them, so the offsets `d2t[i] = ids[i] - i` are >= 0 and never decrease."""
    if not 1 <= size <= len(counts):
        raise ValueError(f"a draft vocabulary of {size} tokens does not fit a vocabulary of {len(counts)}")
    by_frequency = np.argsort(-counts, kind="stable")  # stable: equal counts stay in id order
    return np.sort(by_frequency[:size]).astype(np.int64)


def coverage(counts: np.ndarray, ids: np.ndarray) -> float:
    """The share of the labels whose token is in `ids`."""
    total = int(counts.sum())
    return float(counts[ids].sum()) / total if total else 0.0
