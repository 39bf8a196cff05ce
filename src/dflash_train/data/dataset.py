"""Conversations in -> tokenised examples -> token-budget micro-batches.

The minimal data path: OpenAI `messages` JSONL (optionally gzip) or a built-in source name.
"""

from __future__ import annotations

import gzip
import json
import logging
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np
import torch

from .chat import ConversationError, Tokenized, tokenize_conversation

log = logging.getLogger(__name__)

BUILTIN_SOURCES = ("sharegpt",)


@dataclass
class Dataset:
    examples: list[Tokenized]
    rejected: Counter = field(default_factory=Counter)

    def __len__(self) -> int:
        return len(self.examples)


def _open_text(path: Path):
    return gzip.open(path, "rt", encoding="utf-8") if path.suffix == ".gz" else open(path, encoding="utf-8")


def iter_conversations(source: str) -> Iterator[tuple[str, object]]:
    """Yields (where, messages) with `where` = `file:line` or `sharegpt:#n`."""
    if source in BUILTIN_SOURCES:
        from ..assets import iter_sharegpt_split

        for i, conv in enumerate(iter_sharegpt_split("train")):
            yield f"sharegpt:#{i}", conv["messages"]
        return
    path = Path(source)
    if not path.is_file():
        raise FileNotFoundError(
            f"training data {source!r} not found: give a JSONL file of {{\"messages\": [...]}} rows or one of {BUILTIN_SOURCES}"
        )
    with _open_text(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                yield where, ConversationError(f"invalid JSON ({e.msg})")
                continue
            yield where, row.get("messages") if isinstance(row, dict) else ConversationError("row is not an object")


def load_dataset(
    sources: Iterable[str],
    tokenizer,
    max_length: int,
    block_size: int,
    max_samples: int = 0,
) -> Dataset:
    """Tokenise conversations; drop (and count) rows that are broken or have fewer than
    `2 * block_size` supervised tokens. Each bad row is logged with its `file:line`."""
    ds = Dataset([])
    for source in sources:
        for where, messages in iter_conversations(source):
            if max_samples and len(ds.examples) >= max_samples:
                break
            try:
                if isinstance(messages, Exception):
                    raise messages
                tok = tokenize_conversation(tokenizer, messages, max_length)
            except ConversationError as e:
                ds.rejected[str(e).split(" (")[0]] += 1
                log.warning("skipping %s: %s", where, e)
                continue
            if tok.num_supervised < 2 * block_size:
                ds.rejected["fewer than 2 * block_size supervised tokens"] += 1
                continue
            ds.examples.append(tok)
    if not ds.examples:
        raise ValueError(f"no usable conversation in {list(sources)} (rejected: {dict(ds.rejected)})")
    return ds


def plan_batches(lengths: np.ndarray, token_budget: int, max_batch_size: int, seed: int, epoch: int) -> list[list[int]]:
    """Length-grouped micro-batches: at most `max_batch_size` rows and `token_budget` tokens counting
    padding (rows * longest row). Deterministic per (seed, epoch); batch order shuffled."""
    rng = np.random.default_rng([seed, epoch])
    # Shuffle first so equal lengths mix across epochs, then a stable sort groups by length.
    order = rng.permutation(len(lengths))
    order = order[np.argsort(-lengths[order], kind="stable")]
    batches: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for idx in order:
        n = int(lengths[idx])
        if current and (len(current) + 1 > max_batch_size or max(longest, n) * (len(current) + 1) > token_budget):
            batches.append(current)
            current, longest = [], 0
        current.append(int(idx))
        longest = max(longest, n)
    if current:
        batches.append(current)
    return [batches[i] for i in rng.permutation(len(batches))]


def collate(examples: list[Tokenized], pad_id: int) -> "Batch":
    from ..train.step import Batch

    longest = max(len(e.input_ids) for e in examples)
    ids = torch.full((len(examples), longest), pad_id, dtype=torch.long)
    mask = torch.zeros((len(examples), longest), dtype=torch.long)
    for i, e in enumerate(examples):
        ids[i, : len(e.input_ids)] = torch.from_numpy(e.input_ids.astype(np.int64))
        mask[i, : len(e.loss_mask)] = torch.from_numpy(e.loss_mask.astype(np.int64))
    lengths = torch.tensor([len(e.input_ids) for e in examples], dtype=torch.long)
    return Batch(ids, mask, lengths)
