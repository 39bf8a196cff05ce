"""The trainer's view of its data: `open_training_data(cfg, tokenizer, block_size)`.

Each `data.train_files` entry is a prepared dataset directory (read from its memory-mapped shards,
one example at a time; its tokenizer and chat-template fingerprints must match the target's) or a
raw file / built-in source (tokenised on the fly into memory; its rejected rows are summarised in the
log and, when asked, listed in a `rejects.jsonl`). All entries become one index space.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np

from .chat import Tokenized
from .dataset import TOO_FEW, read_sources, require_examples
from .label_counts import count_labels, padded
from .rejects import Rejects
from .store import (PreparedDataset, check_fingerprints, has_label_counts, is_prepared, no_label_counts_message,
                    read_label_counts, read_manifest)

log = logging.getLogger(__name__)


class _Prepared:
    """The train split of a prepared dataset, seen through the run's max_length, block_size, max_samples."""

    def __init__(self, path: str, tokenizer, target: str, max_length: int, block_size: int, limit: int,
                 split: str = "train"):
        self.ds = PreparedDataset(path, split)
        m = self.ds.manifest
        check_fingerprints(m, tokenizer, path, target)
        self.rejected = Counter(m["counts"]["rejected"])
        self.max_length = max_length
        rows = np.arange(len(self.ds))
        if block_size > m["block_size"]:
            keep = self.ds.num_supervised >= 2 * block_size
            self.rejected[f"{TOO_FEW} (block_size {block_size})"] += int((~keep).sum())
            rows = rows[keep]
            log.warning("%s was prepared for block_size %d; %d rows have fewer than 2 * %d supervised tokens and are "
                        "skipped", path, m["block_size"], int((~keep).sum()), block_size)
        if m["max_length"] > max_length:
            log.warning("%s was prepared with max_length %d; rows are truncated to data.max_length=%d when read",
                        path, m["max_length"], max_length)
        if limit:
            rows = rows[:limit]
        self.rows = rows
        self.lengths = np.minimum(self.ds.lengths[rows], max_length)
        # supervised tokens counted before truncation: an upper bound of each row's anchor positions
        self.anchor_positions = np.minimum(self.ds.num_supervised[rows], self.lengths - block_size + 1)
        self.description = f"{path} ({split} split: {len(rows)} rows, {int(self.lengths.sum())} tokens)"

    def label_counts(self) -> np.ndarray:
        """The label token counts `prepare` stored: of the whole train split as prepared (what max_samples, a
        larger block_size or a shorter max_length leave out of this run counts too)."""
        return read_label_counts(self.ds.path, self.ds.manifest)

    def example(self, j: int) -> Tokenized:
        ex = self.ds.example(int(self.rows[j]))
        if len(ex.input_ids) > self.max_length:
            ex = Tokenized(ex.input_ids[: self.max_length], ex.loss_mask[: self.max_length])
        return ex


class _InMemory:
    def __init__(self, source: str, tokenizer, max_length: int, block_size: int, limit: int,
                 listed_in: Optional[Path], skip_damaged_files: bool = False):
        ds = read_sources([source], tokenizer, max_length, block_size, limit, listed_in=listed_in,
                          skip_damaged_files=skip_damaged_files)
        self.dataset = ds
        self.examples = ds.examples
        self.rejected = ds.rejected
        self.rejects = ds.rejects
        self.source = source
        self.lengths = np.array([len(e.input_ids) for e in ds.examples], dtype=np.int64)
        self.anchor_positions = np.array([int(np.count_nonzero(e.loss_mask[:len(e.input_ids) - block_size + 1]))
                                          for e in ds.examples], dtype=np.int64)
        self.description = f"{source} (tokenised on the fly: {len(ds)} rows, {int(self.lengths.sum())} tokens)"

    def label_counts(self) -> np.ndarray:
        return count_labels(self.examples, 0)

    def example(self, j: int) -> Tokenized:
        return self.examples[j]


@dataclass
class TrainingData:
    """All training rows: `lengths[i]` tokens in row i, `example(i)` its ids and loss mask."""

    parts: list
    lengths: np.ndarray
    rejected: Counter = field(default_factory=Counter)
    _starts: Optional[np.ndarray] = None

    def __post_init__(self) -> None:
        self._starts = np.cumsum([0] + [len(p.lengths) for p in self.parts])

    def __len__(self) -> int:
        return len(self.lengths)

    @property
    def num_rows(self) -> int:
        return len(self.lengths)

    @property
    def anchor_positions(self) -> np.ndarray:
        """Per row, the positions that can anchor a block (supervised, a whole block before the row's end), or
        an upper bound of them (a prepared dataset's supervised tokens): what bounds a batch's block count."""
        return np.concatenate([p.anchor_positions for p in self.parts]).astype(np.int64)

    def example(self, i: int) -> Tokenized:
        k = int(np.searchsorted(self._starts, i, side="right")) - 1
        return self.parts[k].example(i - int(self._starts[k]))

    def label_counts(self, vocab_size: int) -> np.ndarray:
        """How often each target token id is a label (supervised) in these rows, `[vocab_size]` int64: a prepared
        directory's stored counts, a raw entry's counted now."""
        total = np.zeros(vocab_size, dtype=np.int64)
        for part in self.parts:
            total += padded(part.label_counts(), vocab_size, part.description)
        return total

    def describe(self) -> str:
        parts = "; ".join(p.description for p in self.parts)
        rejected = ", ".join(f"{r}: {n}" for r, n in self.rejected.most_common()) or "none"
        return f"{self.num_rows} rows, {int(self.lengths.sum())} tokens from {parts}; rejected {rejected}"


def _list_rejects_then_check(parts: list, rejects_path: Optional[Path]) -> None:
    """Every rejected row of the raw entries to `rejects_path` (when given and there is a raw entry), then
    stop on a raw entry with no usable row."""
    raw = [p for p in parts if isinstance(p, _InMemory)]
    if rejects_path is not None and raw:
        rejects = Rejects()
        for part in raw:
            rejects.extend(part.rejects)
        rejects.write(rejects_path)
    for part in raw:
        require_examples(part.dataset, [part.source])


def open_training_data(cfg, tokenizer, block_size: int, rejects_path: Optional[Path] = None) -> TrainingData:
    """`cfg.data.train_files` as one TrainingData (at most `cfg.data.max_samples` rows when set), for a drafter of
    `block_size` (the drafter config's, which the trainer passes). Rows of raw entries that are rejected are
    summarised in the log and, with `rejects_path`, all listed there."""
    files = list(cfg.data.train_files)
    if not files:
        raise ValueError("data.train_files is empty: give conversation files, prepared dataset directories "
                         "(dflash-train prepare) or 'sharegpt'")
    parts, rejected = [], Counter()
    limit = cfg.data.max_samples
    taken = 0
    for entry in files:
        remaining = limit - taken if limit else 0
        if limit and remaining <= 0:
            break
        if is_prepared(entry):
            part = _Prepared(entry, tokenizer, cfg.target.path, cfg.data.max_length, block_size, remaining)
        else:
            part = _InMemory(entry, tokenizer, cfg.data.max_length, block_size, remaining, rejects_path,
                             cfg.data.skip_damaged_files)
        parts.append(part)
        rejected.update(part.rejected)
        taken += len(part.lengths)
    _list_rejects_then_check(parts, rejects_path)
    lengths = np.concatenate([p.lengths for p in parts]).astype(np.int64)
    if not len(lengths):
        raise ValueError(f"no training rows in {files} (rejected: {dict(rejected)})")
    return TrainingData(parts, lengths, rejected)


def require_label_counts(cfg) -> None:
    """With `drafter.draft_vocab_size` > 0, every prepared `data.train_files` entry must hold the label counts
    the draft vocabulary is chosen from (checked before anything loads or is written)."""
    if not cfg.drafter.draft_vocab_size:
        return
    for entry in cfg.data.train_files:
        if is_prepared(entry) and not has_label_counts(read_manifest(entry)):
            raise ValueError(f"config key 'drafter.draft_vocab_size': {no_label_counts_message(entry)}")


def open_validation_data(cfg, tokenizer, block_size: int,
                         rejects_path: Optional[Path] = None) -> Optional[TrainingData]:
    """The val splits of prepared `data.train_files` plus `data.val_files`, for a drafter of `block_size`; None when
    there is none.
    Rejected rows of raw `data.val_files` are summarised in the log and, with `rejects_path`, listed there."""
    parts = []
    for entry in cfg.data.train_files:
        if is_prepared(entry):
            parts.append(_Prepared(entry, tokenizer, cfg.target.path, cfg.data.max_length, block_size, 0, "val"))
    for entry in cfg.data.val_files:
        if is_prepared(entry):
            parts.append(_Prepared(entry, tokenizer, cfg.target.path, cfg.data.max_length, block_size, 0, "val"))
        else:
            parts.append(_InMemory(entry, tokenizer, cfg.data.max_length, block_size, 0, rejects_path,
                                   cfg.data.skip_damaged_files))
    _list_rejects_then_check(parts, rejects_path)
    parts = [p for p in parts if len(p.lengths)]
    if not parts:
        return None
    return TrainingData(parts, np.concatenate([p.lengths for p in parts]).astype(np.int64))
