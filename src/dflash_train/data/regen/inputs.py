"""What a regen run reads: its settings and, per input row, the prompts the target answers."""

from __future__ import annotations

import hashlib
from collections import Counter
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional, Union

from ..formats import BUILTIN_SOURCES, RowError, builtin_file, iter_source, prompt_turns


# generate: HF generate over left-padded batches. continuous: transformers' continuous batching (paged KV cache, no
# padding, a row leaves the batch at its stop token); greedy only.
ENGINES = ("generate", "continuous")


@dataclass
class RegenSettings:
    max_new_tokens: int = 512
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    stop_token_ids: Optional[list[int]] = None  # None: the target's (dflash_target.json), else its eos
    thinking: Optional[bool] = None  # enable_thinking for the chat template (None: not passed)
    seed: int = 0
    batch_size: int = 16
    batch_tokens: int = 0  # rows x (longest prompt + max_new_tokens) per generate call at most; 0 = no bound
    limit: int = 0  # the first N input rows (bad ones included); 0 = all
    max_turns: int = 0  # answer only the first N user turns of each row; 0 = all
    sort_window: int = 4096  # rows sorted by prompt length together
    max_prompt_tokens: Optional[int] = None  # None: the target's context minus max_new_tokens
    dtype: str = "auto"  # auto: bfloat16 on GPU, float32 on CPU
    device: str = "auto"
    progress: bool = True
    model_name: Optional[str] = None  # batch export: body.model (default: --target as given)
    skip_damaged_files: bool = False  # a damaged --data file: its rows before the damage (default: stop)
    engine: str = "generate"  # one of ENGINES


def batch_seed(seed: int, key: str) -> int:
    """The sampling seed of one batch and turn (or one request): a resume draws the same numbers."""
    return int.from_bytes(hashlib.sha256(f"{seed}|{key}".encode()).digest()[:8], "little") & ((1 << 63) - 1)


@dataclass
class Convo:
    """What regen keeps of a good input row: its id, an optional system turn and the user turns."""

    id: str
    system: list[dict[str, str]]
    users: list[str]


Entry = tuple[str, Union[Convo, RowError]]


def _convo(where: str, row: Any, max_turns: int = 0) -> Union[Convo, RowError]:
    if isinstance(row, RowError):
        return row
    try:
        prompts = prompt_turns(row)
    except RowError as e:
        return e
    return Convo(where, prompts.system, prompts.users[:max_turns or None])


def check_sources(sources: Iterable[str]) -> list[str]:
    """Fail before any model loads: every source must be a built-in name or an existing file."""
    sources = [str(s) for s in sources]
    if not sources:
        raise ValueError("no --data given")
    dup = [s for s, n in Counter(sources).items() if n > 1]
    if dup:
        raise ValueError(f"--data lists {dup[0]!r} twice")
    for spec in sources:
        if spec in BUILTIN_SOURCES:
            builtin_file(spec)
        elif not Path(spec).is_file():
            raise FileNotFoundError(
                f"--data {spec!r}: no such file (built-in sets: {', '.join(BUILTIN_SOURCES)}; "
                "files: JSONL, JSON, Parquet)")
    return sources


def iter_entries(sources: list[str], limit: int = 0, damaged: Optional[list] = None,
                 max_turns: int = 0) -> Iterator[Entry]:
    """(id, Convo or RowError) per row of the sources (ids as `formats` gives them), the first `limit`, each with
    at most `max_turns` user turns (0: all). A damaged file raises DamagedDataFile, unless `damaged` collects it
    (`formats.iter_source`)."""
    rows = (item for spec in sources for item in iter_source(spec, damaged=damaged))
    for where, row in islice(rows, limit or None):  # stops at the limit: a damage after it is never reached
        yield where, _convo(where, row, max_turns)


def windows(entries: Iterator[Entry], size: int) -> Iterator[list[Entry]]:
    buf: list[Entry] = []
    for e in entries:
        buf.append(e)
        if len(buf) >= size:
            yield buf
            buf = []
    if buf:
        yield buf
