"""Conversations in -> tokenised examples -> token-budget micro-batches.

`tokenize_row` holds the rules every path shares (`prepare` and on-the-fly loading): row shape ->
messages, trailing user turns dropped, at least one assistant turn, chat template + loss mask,
reject far over `max_length` (more than 4x), truncate, at least `2 * block_size` supervised tokens.
`load_dataset` tokenises raw files into memory (small data) and summarises its rejects per reason
(`rejects.Rejects`); prepared directories are read by `store.PreparedDataset`, and
`source.open_training_data` picks between them.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator, Optional

import numpy as np

from .chat import ConversationError, Tokenized, tokenize_conversation
from .formats import RowError, iter_source, to_messages
from .rejects import Rejects

log = logging.getLogger(__name__)

__all__ = ["Dataset", "tokenize_row", "load_dataset", "plan_batches", "batches_from",
           "padding_fraction"]

NO_ASSISTANT = "no assistant turn (run regen first)"
FAR_OVER = "far over max_length"
TOO_FEW = "too few supervised tokens"
TEMPLATE = "chat template"
FAR_FACTOR = 4  # a row longer than FAR_FACTOR * max_length tokens is rejected instead of truncated


def tokenize_row(tokenizer, row, max_length: int, block_size: int,
                 template_kwargs: dict | None = None) -> tuple[Tokenized, list[dict], bool]:
    """(example, messages, truncated) for a usable row; raises RowError with a countable reason otherwise."""
    if isinstance(row, RowError):
        raise row
    messages = to_messages(row)
    while messages and messages[-1]["role"] == "user":  # nothing is learnt after the last answer
        messages = messages[:-1]
    if not any(m["role"] == "assistant" for m in messages):
        raise RowError(NO_ASSISTANT)
    far = FAR_FACTOR * max_length
    try:
        tok = tokenize_conversation(tokenizer, messages, far + 1, template_kwargs)
    except ConversationError as e:
        raise RowError(TEMPLATE, str(e)) from None
    except Exception as e:  # a template that raises on this row (e.g. a role it does not accept)
        raise RowError(TEMPLATE, f"{type(e).__name__}: {e}") from None
    n = len(tok.input_ids)
    if n > far:
        raise RowError(FAR_OVER, f"more than {far} tokens ({FAR_FACTOR} x max_length {max_length})")
    if n > max_length:
        tok = Tokenized(tok.input_ids[:max_length], tok.loss_mask[:max_length])
    if tok.num_supervised < 2 * block_size:
        raise RowError(TOO_FEW, f"{tok.num_supervised} < 2 * block_size = {2 * block_size}")
    return tok, messages, n > max_length


@dataclass
class Dataset:
    examples: list[Tokenized]
    rejects: Rejects = field(default_factory=Rejects)
    damaged: Optional[list] = None  # a list: damaged files are collected here (their rows before the damage kept)

    def __len__(self) -> int:
        return len(self.examples)

    @property
    def rejected(self) -> Counter:
        """Rejected rows per reason."""
        return self.rejects.counts


def _load_source(source: str, tokenizer, max_length: int, block_size: int, limit: int,
                 template_kwargs: dict | None, ds: Dataset) -> tuple[Rejects, int]:
    """Append the usable rows of one source to `ds` (until it holds `limit`, when set); its rejects and rows read.
    A damaged file raises DamagedDataFile, unless `ds.damaged` collects it."""
    rejects, read = Rejects(), 0
    if limit and len(ds.examples) >= limit:
        return rejects, read
    for where, row in iter_source(source, damaged=ds.damaged):
        read += 1
        try:
            tok, _, _ = tokenize_row(tokenizer, row, max_length, block_size, template_kwargs)
        except RowError as e:
            rejects.add_error(where, e)
            continue
        ds.examples.append(tok)
        if limit and len(ds.examples) >= limit:  # stop here: a damage after the limit is never reached
            break
    return rejects, read


def read_sources(sources: list[str], tokenizer, max_length: int, block_size: int, max_samples: int = 0,
                 template_kwargs: dict | None = None, listed_in: Optional[Path] = None,
                 skip_damaged_files: bool = False) -> Dataset:
    """The usable rows of `sources` in memory, and their rejects; logs one line per reason per source
    (with the first ids) and says that the full list is in `listed_in`, which the caller writes. A damaged
    file raises DamagedDataFile, or with `skip_damaged_files` gives its rows before the damage and a warning."""
    ds = Dataset([], damaged=[] if skip_damaged_files else None)
    for source in sources:
        rejects, read = _load_source(source, tokenizer, max_length, block_size, max_samples, template_kwargs, ds)
        rejects.log_summary(log, source, read, listed_in)
        ds.rejects.extend(rejects)
    for e in ds.damaged or ():
        log.warning("%s", e.cut_line())
    return ds


def require_examples(ds: Dataset, sources: list[str]) -> None:
    if not ds.examples:
        first = "; ".join(ds.rejects.first_lines())
        raise ValueError(f"no usable conversation in {sources} (rejected: {dict(ds.rejected)})"
                         + (f". First rejects: {first}" if first else ""))


def load_dataset(
    sources: Iterable[str],
    tokenizer,
    max_length: int,
    block_size: int,
    max_samples: int = 0,
    template_kwargs: dict | None = None,
    rejects_path: Optional[Path] = None,
) -> Dataset:
    """Tokenise conversations (any supported file shape, or a built-in source) into memory; drop unusable
    rows, log one line per reason per source (with the first ids) and, when `rejects_path` is given,
    write every rejected row there (`rejects.jsonl` records). For large data use `dflash-train prepare`."""
    sources = list(sources)
    ds = read_sources(sources, tokenizer, max_length, block_size, max_samples, template_kwargs, rejects_path)
    if rejects_path is not None:
        ds.rejects.write(rejects_path)
    require_examples(ds, sources)
    return ds


def plan_batches(lengths: np.ndarray, token_budget: int, max_batch_size: int, seed: int, epoch: int) -> list[list[int]]:
    """Length-grouped micro-batches: at most `max_batch_size` rows and `token_budget` tokens counting
    padding (rows * longest row). Deterministic per (seed, epoch); batch order shuffled."""
    if len(lengths) and int(np.max(lengths)) > token_budget:
        raise ValueError(
            f"a conversation of {int(np.max(lengths))} tokens does not fit data.token_budget={token_budget}; "
            "set data.token_budget to at least data.max_length (or lower data.max_length)"
        )
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


def padding_fraction(lengths: np.ndarray, batches: list[list[int]]) -> float:
    """Share of the planned batch tokens (rows * longest row) that are padding."""
    total = sum(int(lengths[b].max()) * len(b) for b in batches)
    real = sum(int(lengths[b].sum()) for b in batches)
    return (total - real) / total if total else 0.0


def batches_from(lengths: np.ndarray, token_budget: int, max_batch_size: int, seed: int,
                 epoch: int = 0, batch_index: int = 0) -> Iterator[tuple[int, int, int, list[int]]]:
    """Endless `(epoch, batch_index, batches_in_epoch, rows)` from a position on: the batches of an
    uninterrupted run from there, since each epoch's plan depends on (seed, epoch) only. A checkpoint
    stores the position after its last batch; `batch_index` may equal the epoch's batch count."""
    if not len(lengths):
        raise ValueError("no rows to batch")
    while True:
        plan = plan_batches(lengths, token_budget, max_batch_size, seed, epoch)
        for index in range(batch_index, len(plan)):
            yield epoch, index, len(plan), plan[index]
        epoch, batch_index = epoch + 1, 0

