"""The one source reader: every `--data` (files in JSONL / JSON array / Parquet, folders of them, built-in
sets) -> `(id, row)`, and rows in any common shape -> chat messages or the prompts to answer.

Recognised row shapes:
- ShareGPT: `{"conversations": [{"from": "human"|"gpt"|..., "value": str}, ...]}`
- OpenAI:   `{"messages": [{"role": "system"|"user"|"assistant", "content": str}, ...]}`
  (`content` may also be a list of `{"type": "text", "text": str}` parts)
- `{"prompt": str, "response": str}` and `{"prompt": str}` (a prompt only: regen writes the answer)
- `{"turns": [str, ...]}`: consecutive user turns, no answers yet (MT-Bench)
Every bad row raises `RowError` with a short, countable reason. Row ids say where the row is: `file:line`
(JSONL), `file:#index` (JSON array, Parquet), `sharegpt:#index` (the training split; the held-out split
eval reads: `sharegpt-heldout:#index`), `mt-bench:<question_id>`, `humaneval:<task_id>`.
Reading is streaming for every format: memory does not grow with the file.
A damaged file (cut short, bad compression, a bad gzip or Parquet header, empty) is not a bad row: reading
raises `DamagedDataFile` naming the file and where it stopped, unless the caller collects it (`iter_source`'s
`damaged`), which keeps the rows before the damage.
"""

from __future__ import annotations

import codecs
import gzip
import json
import reprlib
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Iterator, Optional, Union

from .. import assets
from ..errors import DamagedFileError, format_share

SHAREGPT_ROLES = {
    "human": "user", "user": "user",
    "gpt": "assistant", "chatgpt": "assistant", "assistant": "assistant", "bard": "assistant", "bing": "assistant",
    "model": "assistant", "system": "system",
}
ROLES = ("system", "user", "assistant")

# Built-in sources addressable by name (`--data sharegpt`). mt-bench and humaneval are prompts only.
BUILTIN_SOURCES = ("sharegpt", "mt-bench", "humaneval")
DATA_SUFFIXES = (".jsonl", ".jsonl.gz", ".json", ".json.gz", ".parquet")


class RowError(ValueError):
    """A row that cannot be used; `reason` is a short category for the summary counts, `detail` says
    what exactly is wrong with this row."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


def _content(content: Any, role: str, i: int) -> str:
    if isinstance(content, list):  # OpenAI content parts
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise RowError("wrong type", f"turn {i} ({role}) has a content part that is not text")
            texts.append(part["text"])
        content = "".join(texts)
    if content is None:
        raise RowError("missing turns", f"turn {i} ({role}) has no content")
    if not isinstance(content, str):
        raise RowError("wrong type", f"turn {i} ({role}) content is {type(content).__name__}, not a string")
    if not content.strip():
        raise RowError("empty turn", f"turn {i} ({role}) is empty")
    try:
        content.encode("utf-8")
    except UnicodeEncodeError:
        raise RowError("not UTF-8", f"turn {i} ({role}) holds a lone surrogate (an escaped byte that is not text)") from None
    return content


def _turn(role: Any, content: Any, i: int) -> dict[str, str]:
    if role not in ROLES:
        raise RowError("unknown role", f"turn {i} has role {reprlib.repr(role)}")
    return {"role": role, "content": _content(content, role, i)}


def _user_turns(turns: Any) -> list[str]:
    if not isinstance(turns, list):
        raise RowError("wrong type", f"'turns' is a {type(turns).__name__}, not a list")
    if not turns:
        raise RowError("missing turns", "no turns")
    return [_content(t, "user", i) for i, t in enumerate(turns)]


def _present(row: Any) -> dict:
    if not isinstance(row, dict):
        raise RowError("wrong type", f"row is a {type(row).__name__}, not an object")
    return {k: v for k, v in row.items() if v is not None}  # Parquet: absent columns are nulls


def _is_turns_row(row: dict) -> bool:
    return "turns" in row and not any(k in row for k in ("messages", "conversations", "prompt"))


def to_messages(row: Any) -> list[dict[str, str]]:
    """The row as chat messages. A prompt-only row ends with a user turn (no assistant yet); of a `turns`
    row that is its first turn (the later ones wait for the answers to the earlier)."""
    row = _present(row)
    if _is_turns_row(row):
        return [{"role": "user", "content": _user_turns(row["turns"])[0]}]
    if "messages" in row:
        turns = row["messages"]
        if not isinstance(turns, list):
            raise RowError("wrong type", f"'messages' is a {type(turns).__name__}, not a list")
        msgs = []
        for i, t in enumerate(turns):
            if not isinstance(t, dict):
                raise RowError("wrong type", f"turn {i} is a {type(t).__name__}, not an object")
            msgs.append(_turn(t.get("role"), t.get("content"), i))
    elif "conversations" in row:
        turns = row["conversations"]
        if not isinstance(turns, list):
            raise RowError("wrong type", f"'conversations' is a {type(turns).__name__}, not a list")
        msgs = []
        for i, t in enumerate(turns):
            if not isinstance(t, dict):
                raise RowError("wrong type", f"turn {i} is a {type(t).__name__}, not an object")
            sender = t.get("from")
            role = SHAREGPT_ROLES.get(sender.lower()) if isinstance(sender, str) else None
            if role is None:
                raise RowError("unknown role", f"turn {i} has from={reprlib.repr(sender)}")
            msgs.append(_turn(role, t.get("value"), i))
    elif "prompt" in row:
        msgs = [_turn("user", row["prompt"], 0)]
        if "response" in row:
            msgs.append(_turn("assistant", row["response"], 1))
    else:
        raise RowError("unknown shape", f"keys {sorted(row)[:8]}; expected messages, conversations, prompt or turns")
    if not msgs:
        raise RowError("missing turns", "no turns")
    body = msgs[1:] if msgs[0]["role"] == "system" else msgs
    if not body or body[0]["role"] != "user":
        raise RowError("bad turn order", "the first turn (after an optional system turn) must be the user's")
    for i, m in enumerate(body):
        expected = "user" if i % 2 == 0 else "assistant"
        if m["role"] != expected:
            raise RowError("bad turn order", f"turn {i} is {m['role']}, expected {expected} (turns must alternate)")
    return msgs


@dataclass
class PromptTurns:
    """What a target answers turn by turn: the row's system turn (or none) and its user turns.
    `answered`: the row holds assistant turns, so its later user turns reply to answers the target did
    not write."""

    system: list[dict[str, str]]
    users: list[str]
    answered: bool


def prompt_turns(row: Any) -> PromptTurns:
    """The prompts of a row (any shape); raises RowError like `to_messages`."""
    row = _present(row)
    if _is_turns_row(row):
        return PromptTurns([], _user_turns(row["turns"]), False)
    msgs = to_messages(row)
    system = [dict(msgs[0])] if msgs[0]["role"] == "system" else []
    return PromptTurns(system, [m["content"] for m in msgs if m["role"] == "user"],
                       any(m["role"] == "assistant" for m in msgs))


Row = Union[dict, RowError]


# ----------------------------------------------------------------------------------------- files


class DamagedDataFile(DamagedFileError):
    """A data file that cannot be read to its end; the rows before the damage were yielded. `skip_option`
    is how the command asks to use them (train says its config key instead)."""

    skip_option = "--skip-damaged-files"

    def __init__(self, path, problem: str, *, rows_read: int, bytes_read: Optional[int] = None,
                 size: Optional[int] = None):
        super().__init__(path, problem, "", rows_read=rows_read, bytes_read=bytes_read, size=size)

    def __str__(self) -> str:
        use = f"to use the {_rows(self.rows_read)} before the damage" if self.rows_read else "to leave it out"
        return (f"{self.path} is damaged ({self.problem}){self.where()}: re-create or re-download it, "
                f"or pass {self.skip_option} {use}")

    def where(self) -> str:
        return "" if self.problem.startswith("empty") else super().where()  # an empty file has no place to name

    @classmethod
    def from_record(cls, record: dict) -> "DamagedDataFile":
        return cls(record["path"], record["error"], rows_read=record["rows_read"], bytes_read=record["bytes_read"],
                   size=record["size"])

    def record(self) -> dict:
        """What a manifest or summary keeps of a file skipped past its damage."""
        return {"path": self.path, "rows_read": self.rows_read, "bytes_read": self.bytes_read, "size": self.size,
                "error": self.problem}

    def cut_line(self) -> str:
        """The summary line of a file used up to its damage."""
        if self.problem.startswith("empty"):
            return f"{self.path} left out: {self.problem}"
        read = f", read {format_share(self.bytes_read, self.size)}" if self.bytes_read is not None and self.size else ""
        return (f"{self.path} is damaged ({self.problem}): cut at row {self.rows_read}{read}; "
                f"used the {_rows(self.rows_read)} before the damage")


def _rows(n: int) -> str:
    return f"{n} row" if n == 1 else f"{n} rows"


class _Cut(Exception):
    """Raised inside a reader where the file's own structure shows it is cut short or corrupt."""


def _damage(e: BaseException) -> str:
    """What a reader's or the gzip decompressor's exception says about the file. (Other OS errors, such as a
    permission or a failing disk, are not damage: they keep their own one-line report.)"""
    if isinstance(e, EOFError):
        return "cut short: the gzip stream ends early"
    if isinstance(e, zlib.error):
        return f"bad deflate data: {str(e).split(': ', 1)[-1]}"
    if isinstance(e, gzip.BadGzipFile):
        return f"bad gzip data: {e}"
    return str(e)  # _Cut


def _open_bytes(path: Path, raw: Optional[BinaryIO] = None):
    if path.suffix == ".gz":
        return gzip.GzipFile(fileobj=raw, mode="rb") if raw is not None else gzip.open(path, "rb")
    return raw if raw is not None else open(path, "rb")


def _sniff(path: Path) -> str:
    """'parquet', 'array' or 'jsonl': by name for .parquet / .jsonl(.gz); else Parquet by magic bytes, JSON
    array by a leading '['."""
    name = path.name.lower()
    if name.endswith(".parquet"):
        return "parquet"
    if name.endswith((".jsonl", ".jsonl.gz")):  # a JSONL row may itself start with '['
        return "jsonl"
    with _open_bytes(path) as f:
        head = f.read(4096)
    if head[:4] == b"PAR1":
        return "parquet"
    stripped = head.lstrip(b"\xef\xbb\xbf \t\r\n")
    return "array" if stripped[:1] == b"[" else "jsonl"


def iter_rows(path: Path) -> Iterator[tuple[str, Row]]:
    """Rows of a JSONL (`.jsonl`, `.jsonl.gz`), JSON array (`.json`, `.json.gz`) or Parquet file, streaming.
    A row that does not decode is yielded as a RowError (never raised), so good rows are never lost. A damaged
    file raises DamagedDataFile after its last readable row."""
    path = Path(path)
    size = path.stat().st_size
    if size == 0:
        raise DamagedDataFile(path, "empty: 0 bytes, it holds no rows", rows_read=0, bytes_read=0, size=0)
    rows, kind = 0, ""
    with open(path, "rb") as raw:
        try:
            kind = _sniff(path)
            if kind == "parquet":
                reader = _iter_parquet(path)
            else:
                stream = _open_bytes(path, raw)
                reader = _iter_json_array(path, stream) if kind == "array" else _iter_jsonl(path, stream)
            for where, row in reader:
                rows += 1
                yield where, row
        except (_Cut, EOFError, zlib.error, gzip.BadGzipFile) as e:
            raise DamagedDataFile(path, _damage(e), rows_read=rows, bytes_read=None if kind == "parquet" else
                                  min(raw.tell(), size), size=size) from e


def _iter_jsonl(path: Path, f: BinaryIO) -> Iterator[tuple[str, Row]]:
    """One row per line. A last line without its newline that does not parse is where the file was cut
    (a bad line anywhere else is one rejected row). A file of blank lines only is empty."""
    rows = 0
    for lineno, raw in enumerate(f, 1):
        where = f"{path}:{lineno}"
        cut = not raw.endswith(b"\n")  # only the last line can lack it
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            if cut and e.reason == "unexpected end of data":
                raise _Cut(f"cut short: its last line, line {lineno}, ends inside a character") from None
            rows += 1
            yield where, RowError("not UTF-8", f"invalid byte at column {e.start + 1}")
            continue
        if lineno == 1:
            line = line.lstrip("\ufeff")
        if not line.strip():
            continue
        rows += 1
        text = line.rstrip("\r\n")  # with its newline, an error at the end would be placed on the next line
        try:
            row = json.loads(text)
        except json.JSONDecodeError as e:
            if cut:
                raise _Cut(f"cut short: its last line, line {lineno}, has no newline and is not valid JSON "
                           f"({_column(e, text)})") from None
            yield where, RowError("invalid JSON", _column(e, text))
            continue
        except (ValueError, RecursionError) as e:  # valid JSON Python will not hold: only this row is bad
            yield where, RowError("invalid JSON", _unloadable(e))
            continue
        yield where, row
    if not rows:
        raise _Cut("empty: only blank lines, it holds no rows")


def _column(e: json.JSONDecodeError, text: str) -> str:
    """What is wrong and where on its line: `... at column C`, or, for a line that ends too early, after its last
    column. (Some of json's messages end in "at" already: "Unterminated string starting at".)"""
    what = e.msg.removesuffix(" at")
    if e.pos >= len(text):
        return f"{what} after column {len(text)}, where the line ends"
    return f"{what} at column {e.colno}"


_CHUNK = 1 << 20
_MAX_ELEMENT = 256 << 20  # a JSON array element larger than this is not a conversation


def _iter_json_array(path: Path, f: BinaryIO) -> Iterator[tuple[str, Row]]:
    """A JSON array decoded one element at a time from a bounded window of the file. Bytes that are
    not UTF-8 only spoil the element that holds them. An element that does not parse makes the rest of
    the array unreadable (JSON has no line boundaries to resync on): the file is damaged from there."""
    decoder = json.JSONDecoder()
    utf8 = codecs.getincrementaldecoder("utf-8")(errors="surrogateescape")
    buf, pos, eof = "", 0, False

    def more() -> bool:
        nonlocal buf, pos, eof
        if eof:
            return False
        data = f.read(max(_CHUNK, len(buf) - pos))  # grow geometrically: linear time for big elements
        eof = not data
        buf = buf[pos:] + utf8.decode(data, final=eof)
        pos = 0
        return bool(data)

    def skip_space(chars: str) -> bool:
        """Skip `chars`; False at the end of the file."""
        nonlocal pos
        while True:
            while pos < len(buf) and buf[pos] in chars:
                pos += 1
            if pos < len(buf):
                return True
            if not more():
                return False

    if not skip_space("\ufeff \t\r\n") or buf[pos] != "[":
        yield f"{path}", RowError("invalid JSON", "not a JSON array")
        return
    pos += 1
    index = 0
    while True:
        if not skip_space(" \t\r\n,"):
            raise _Cut(f"cut short: the JSON array ends after {index} elements without its closing ']'")
        if buf[pos] == "]":
            pos += 1
            if skip_space(" \t\r\n"):
                yield f"{path}:#{index}", RowError("invalid JSON", "data after the end of the array (not read)")
            return
        unloadable = None
        while True:
            try:
                row, end = decoder.raw_decode(buf, pos)
                break
            except json.JSONDecodeError as e:
                if len(buf) - pos > _MAX_ELEMENT or not more():
                    raise _Cut(_unparsable_element(index, e, _value_end(buf, pos) is None)) from None
            except (ValueError, RecursionError) as e:  # valid JSON Python will not hold: skip this element
                unloadable, end = e, _value_end(buf, pos)
                if end is not None:
                    break
                if len(buf) - pos > _MAX_ELEMENT or not more():
                    raise _Cut(f"element #{index} is {_unloadable(e)} and its end cannot be found: the rest "
                               "of the array cannot be read") from None
        text, pos = buf[pos:end], end
        where = f"{path}:#{index}"
        index += 1
        if unloadable is not None:
            yield where, RowError("invalid JSON", _unloadable(unloadable))
            continue
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            yield where, RowError("not UTF-8", "the element holds bytes that are not UTF-8")
            continue
        yield where, row


def _unparsable_element(index: int, e: json.JSONDecodeError, unclosed: bool) -> str:
    """Why reading an array stops at element `index`: cut inside it (its brackets or quotes never close), or
    a broken element in the middle."""
    if unclosed:
        return f"cut short: the file ends inside element #{index} of the JSON array"
    return f"element #{index} is not valid JSON ({e.msg}): the rest of the array cannot be read"


def _unloadable(e: BaseException) -> str:
    """Why a syntactically plausible JSON value could not be loaded (Python's own limits)."""
    if isinstance(e, RecursionError):
        return "nested too deeply"
    return f"{e}".split(";")[0]  # e.g. an integer of more than 4300 digits


def _value_end(buf: str, pos: int) -> int | None:
    """End of the JSON value that starts at `pos`, found by matching brackets outside strings (no
    recursion, no number conversion); None when `buf` ends first."""
    depth, i, n = 0, pos, len(buf)
    while i < n:
        c = buf[i]
        if c == '"':
            i += 1
            while i < n and buf[i] != '"':
                i += 2 if buf[i] == "\\" else 1
            if i >= n:
                return None
        elif c in "[{":
            depth += 1
        elif c in "]}":
            depth -= 1
            if depth < 0:  # the array's own closing bracket ends a scalar
                return i
        elif depth == 0 and c in ", \t\r\n":
            return i
        i += 1
        if depth == 0 and c in '"]}':
            return i
    return None


def _parquet_file(path: Path):
    # Imported on first use: the CLI imports this module to build its parser, and pyarrow.parquet takes
    # 0.18 s to import (measured), more than the rest of `dflash-train status`.
    import pyarrow.parquet as pq

    return pq.ParquetFile(path)


def _iter_parquet(path: Path, batch_rows: int = 1024) -> Iterator[tuple[str, Row]]:
    index = 0
    batches = _parquet_call(path, lambda: _parquet_file(path).iter_batches(batch_size=batch_rows))
    while True:
        batch = _parquet_call(path, lambda: next(batches, None))
        if batch is None:
            return
        for row in _parquet_call(path, batch.to_pylist):
            yield f"{path}:#{index}", row
            index += 1


def _parquet_call(path: Path, call):
    """`call()`, with what pyarrow raises for a bad footer, header or page as `_Cut` (an OS error that has an
    errno, such as a permission, stays itself)."""
    try:
        return call()
    except (OSError, ValueError) as e:
        if isinstance(e, OSError) and e.errno is not None:
            raise
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise _Cut(f"not a readable Parquet file: {first}") from None


# --------------------------------------------------------------------------------------- sources


def expand_source(spec: str) -> list[Path] | str:
    """A `--data` argument: a built-in name (returned as is), a file, or a folder (its data files, sorted).
    Raises FileNotFoundError with what to do when it is none of these."""
    path = Path(spec)
    if path.is_file():
        return [path]
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.name.lower().endswith(DATA_SUFFIXES))
        if not files:
            raise FileNotFoundError(f"data folder {spec!r} holds no {'/'.join(DATA_SUFFIXES)} file")
        return files
    if spec in BUILTIN_SOURCES:
        return spec
    raise FileNotFoundError(
        f"data {spec!r} not found: give a JSONL / JSON / Parquet file, a folder of them, or a built-in source "
        f"({', '.join(BUILTIN_SOURCES)})"
    )


def builtin_file(name: str) -> Path:
    """The packaged file a built-in source reads (for checksums in manifests). Raises FileNotFoundError,
    saying what to install, when its package is missing."""
    getter = {"sharegpt": assets.sharegpt_path, "mt-bench": assets.mtbench_path, "humaneval": assets.humaneval_path}
    try:
        return getter[name]()
    except assets.AssetPackageMissing as e:
        raise FileNotFoundError(str(e)) from None


def iter_builtin(name: str, sharegpt_split: str = "train") -> Iterator[tuple[str, Row]]:
    """Rows of a built-in source: ShareGPT's training split (or, for eval, its held-out split) as `messages`;
    MT-Bench and HumanEval as prompt-only `turns` rows."""
    if name == "sharegpt":
        prefix = "sharegpt" if sharegpt_split == "train" else f"sharegpt-{sharegpt_split}"
        for i, conv in enumerate(assets.iter_sharegpt_split(sharegpt_split)):
            yield f"{prefix}:#{i}", {"messages": conv["messages"]}
    elif name in ("mt-bench", "humaneval"):
        items = assets.iter_mtbench() if name == "mt-bench" else assets.iter_humaneval()
        for item in items:
            yield f"{name}:{item['id']}", {"turns": item["turns"]}
    else:
        raise FileNotFoundError(f"unknown built-in source {name!r}; built-in: {', '.join(BUILTIN_SOURCES)}")


def iter_source(spec: str, sharegpt_split: str = "train",
                damaged: Optional[list[DamagedDataFile]] = None) -> Iterator[tuple[str, Row]]:
    """Rows of one `--data` argument (file, folder or built-in name), in a deterministic order. A damaged
    file raises DamagedDataFile; with a `damaged` list it is added there instead (its rows before the damage
    were yielded) and reading goes on with the next file."""
    expanded = expand_source(spec)
    if isinstance(expanded, str):
        yield from iter_builtin(expanded, sharegpt_split)
        return
    for path in expanded:
        try:
            yield from iter_rows(path)
        except DamagedDataFile as e:
            if damaged is None:
                raise
            damaged.append(e)


def require_packages(specs: list[str]) -> None:
    """The package of every built-in source among `specs` is installed (FileNotFoundError saying what to
    install otherwise): looked up, not read."""
    for spec in specs:
        expanded = expand_source(spec)
        if isinstance(expanded, str):
            builtin_file(expanded)


def check_readable(specs: list[str], limit: int = 0) -> None:
    """Read the first `limit` rows of the sources' files (all when 0; a built-in source's package is only
    looked up: FileNotFoundError saying what to install) without using them: a damaged file raises
    DamagedDataFile here, before a command writes or loads anything."""
    n = 0
    for spec in specs:
        expanded = expand_source(spec)
        if isinstance(expanded, str):
            builtin_file(expanded)
            continue
        for _ in iter_source(spec):
            n += 1
            if limit and n >= limit:
                return


def _file_rows(path: Path) -> Iterator[int]:
    kind = _sniff(path)
    if kind == "parquet":
        yield _parquet_file(path).metadata.num_rows
    elif kind == "array":
        yield from (1 for _ in iter_rows(path))
    else:  # counted by lines, without decoding them
        with _open_bytes(path) as f:
            yield from (1 for raw in f if raw.strip())


def _row_counts(spec: str) -> Iterator[int]:
    expanded = expand_source(spec)
    if isinstance(expanded, str):
        yield from (1 for _ in iter_builtin(expanded))
        return
    for path in expanded:
        try:
            yield from _file_rows(path)
        except (DamagedDataFile, EOFError, zlib.error, gzip.BadGzipFile, ValueError):
            continue  # a damaged file counts up to its damage; reading it says what is wrong
        except OSError as e:
            if e.errno is not None:
                raise
            continue  # pyarrow's error for a bad footer


def count_rows(specs: list[str], limit: int = 0) -> int:
    """Rows the sources hold (for a progress bar), up to `limit` when set."""
    total = 0
    for spec in specs:
        for n in _row_counts(spec):
            total += n
            if limit and total >= limit:
                return limit
    return total
