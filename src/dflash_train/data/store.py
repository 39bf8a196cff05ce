"""The prepared-dataset store: a directory of memory-mapped Arrow shards and a manifest.

    DIR/
      manifest.json        format version, tokenizer + chat-template fingerprints, config, counts, sources
      rejects.jsonl        one line per rejected row: {"where": "file:line", "reason": ..., "detail": ...}
      label_counts.npy     how often each token id is a label (supervised) in the train split (`label_counts.py`)
      train/shard-00000.arrow ...
      val/shard-00000.arrow ...

Each shard is an Arrow IPC file (uncompressed, so it memory-maps without copies) with the columns
`input_ids` list<int32>, `loss_mask` list<uint8>, `length` int32 and `num_supervised` int32, written
in record batches of a few thousand rows: neither writing nor reading holds a shard in memory.
Nothing here records time or machine state, so the same input and config give the same bytes.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Optional

import numpy as np
import pyarrow as pa

from ..errors import DamagedFileError
from ..target.fingerprints import chat_template_fingerprint, tokenizer_fingerprint
from ..files.io import read_json_file
from .chat import Tokenized
from .label_counts import read_counts

FORMAT = "dflash-train/prepared"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
REJECTS = "rejects.jsonl"
SPLITS = ("train", "val")

SCHEMA = pa.schema([
    pa.field("input_ids", pa.list_(pa.int32())),
    pa.field("loss_mask", pa.list_(pa.uint8())),
    pa.field("length", pa.int32()),
    pa.field("num_supervised", pa.int32()),
])


# ------------------------------------------------------------------------------------------ files


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return "sha256:" + h.hexdigest()


# ------------------------------------------------------------------------------------------ write


class ShardWriter:
    """Appends examples of one split; flushes a record batch every `batch_rows` rows or `batch_tokens`
    tokens, and starts a new shard file every `shard_rows` rows. Memory: one record batch."""

    def __init__(self, root: Path, split: str, shard_rows: int, batch_rows: int = 2048, batch_tokens: int = 1 << 18):
        self.dir = root / split
        self.split = split
        self.shard_rows = max(1, shard_rows)
        self.batch_rows = max(1, min(batch_rows, self.shard_rows))
        self.batch_tokens = batch_tokens
        self._buffered = 0
        self.shards: list[str] = []
        self.rows = 0
        self.tokens = 0
        self.supervised = 0
        self._ids: list[np.ndarray] = []
        self._masks: list[np.ndarray] = []
        self._writer: Optional[pa.ipc.RecordBatchFileWriter] = None
        self._sink = None
        self._in_shard = 0

    def add(self, ex: Tokenized) -> None:
        self._ids.append(ex.input_ids)
        self._masks.append(ex.loss_mask)
        self.rows += 1
        self.tokens += len(ex.input_ids)
        self.supervised += ex.num_supervised
        self._buffered += len(ex.input_ids)
        if (len(self._ids) >= self.batch_rows or self._buffered >= self.batch_tokens
                or self._in_shard + len(self._ids) >= self.shard_rows):
            self._flush()

    def _flush(self) -> None:
        if not self._ids:
            return
        if self._writer is None:
            self.dir.mkdir(parents=True, exist_ok=True)
            name = f"shard-{len(self.shards):05d}.arrow"
            self.shards.append(f"{self.split}/{name}")
            self._sink = pa.OSFile(str(self.dir / name), "wb")
            self._writer = pa.ipc.new_file(self._sink, SCHEMA)
        lengths = np.fromiter((len(a) for a in self._ids), dtype=np.int32, count=len(self._ids))
        offsets = np.zeros(len(lengths) + 1, dtype=np.int32)
        np.cumsum(lengths, out=offsets[1:])
        ids = np.concatenate(self._ids).astype(np.int32, copy=False)
        masks = np.concatenate(self._masks).astype(np.uint8, copy=False)
        supervised = np.fromiter((int(m.sum()) for m in self._masks), dtype=np.int32, count=len(self._masks))
        batch = pa.record_batch([
            pa.ListArray.from_arrays(pa.array(offsets), pa.array(ids)),
            pa.ListArray.from_arrays(pa.array(offsets), pa.array(masks)),
            pa.array(lengths),
            pa.array(supervised),
        ], schema=SCHEMA)
        self._writer.write_batch(batch)
        self._in_shard += len(lengths)
        self._ids, self._masks, self._buffered = [], [], 0
        if self._in_shard >= self.shard_rows:
            self._close_shard()

    def _close_shard(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._sink.close()
        self._writer, self._sink, self._in_shard = None, None, 0

    def close(self) -> dict:
        self._flush()
        self._close_shard()
        return {"rows": self.rows, "tokens": self.tokens, "supervised_tokens": self.supervised, "shards": self.shards}


def write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")


# ------------------------------------------------------------------------------------------- read


def is_prepared(path: str | Path) -> bool:
    p = Path(path)
    return p.is_dir() and (p / MANIFEST).is_file()


def read_manifest(path: str | Path) -> dict:
    p = Path(path)
    if not (p / MANIFEST).is_file():
        raise FileNotFoundError(f"{p} is not a prepared dataset (no {MANIFEST}); create it with `dflash-train prepare`")
    manifest = read_json_file(p / MANIFEST, _redo(p))
    if not isinstance(manifest, dict) or not all(isinstance(manifest.get(k), dict) for k in ("splits", "counts")):
        raise DamagedFileError(p / MANIFEST, "not a prepared-dataset manifest: no splits or counts", _redo(p))
    if manifest.get("format") != FORMAT or manifest.get("format_version") != FORMAT_VERSION:
        raise ValueError(
            f"{p} is a prepared dataset of format {manifest.get('format')!r} version {manifest.get('format_version')}; "
            f"this dflash-train reads {FORMAT!r} version {FORMAT_VERSION}: re-run `dflash-train prepare`"
        )
    return manifest


def _redo(path: Path) -> str:
    return f"re-create the dataset with `dflash-train prepare ... --out {path} --overwrite`"


def _open_shard(path: Path, dataset: Path):
    """The Arrow IPC reader of one shard; a missing, cut or garbled shard raises DamagedFileError."""
    if not path.is_file():
        raise DamagedFileError(path, "missing: the manifest lists it", _redo(dataset))
    try:
        reader = pa.ipc.open_file(pa.memory_map(str(path), "r"))
        if not reader.schema.equals(SCHEMA):
            raise DamagedFileError(path, f"not a shard of this format: its columns are {reader.schema.names}",
                                   _redo(dataset))
        return reader
    except (pa.ArrowException, OSError) as e:
        if isinstance(e, OSError) and e.errno is not None:
            raise
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DamagedFileError(path, f"not a readable Arrow shard: {first}", _redo(dataset),
                               size=path.stat().st_size) from None


def _shard_batch(reader, index: int, path: Path, dataset: Path):
    try:
        batch = reader.get_batch(index)
        batch.validate(full=True)  # offsets inside the buffers: a garbled batch fails here, not at a later read
        return batch
    except (pa.ArrowException, OSError) as e:
        if isinstance(e, OSError) and e.errno is not None:
            raise
        raise DamagedFileError(path, f"record batch {index} is not readable: {str(e).strip().splitlines()[0]}",
                               _redo(dataset), size=path.stat().st_size) from None


def check_fingerprints(manifest: dict, tokenizer, dataset: str, target: str) -> None:
    """Refuse a prepared dataset made with another tokenizer or chat template than the target's."""
    for key, name, current in (
        ("tokenizer_fingerprint", "tokenizer", tokenizer_fingerprint(tokenizer)),
        ("chat_template_fingerprint", "chat template", chat_template_fingerprint(tokenizer)),
    ):
        if manifest[key] != current:
            raise ValueError(
                f"prepared dataset {dataset} was tokenised with a different {name} than the target {target}: "
                f"dataset {key.replace('_', ' ')} {manifest[key]}, target {current}. Its token ids would be "
                f"wrong for this target: re-run `dflash-train prepare --target {target} --data ... --out DIR` "
                "with this target and train on that directory"
            )


def no_label_counts_message(path: str | Path) -> str:
    return (f"prepared dataset {path} holds no label token counts (it was prepared by a dflash-train older than "
            "drafter.draft_vocab_size), and the reduced draft vocabulary is chosen from them: re-run `dflash-train "
            f"prepare --target ... --data ... --out {path} --overwrite` with the same inputs (it gives the same rows "
            "and adds the counts), or train with drafter.draft_vocab_size=0")


def has_label_counts(manifest: dict) -> bool:
    return isinstance(manifest.get("label_counts"), dict) and "file" in manifest["label_counts"]


def read_label_counts(path: str | Path, manifest: dict) -> np.ndarray:
    """The train split's label token counts stored by `prepare`; a clear error for a directory without them."""
    if not has_label_counts(manifest):
        raise ValueError(no_label_counts_message(path))
    return read_counts(Path(path) / manifest["label_counts"]["file"])


class PreparedDataset:
    """One split of a prepared dataset, memory-mapped: `lengths` is in memory (4 bytes a row), token ids
    and masks are read from the mapped shards when `example(i)` asks for them."""

    def __init__(self, path: str | Path, split: str = "train"):
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        self.path = Path(path)
        self.manifest = read_manifest(self.path)
        self.split = split
        self._chunks: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []  # offsets, ids, masks, nsup
        starts, lengths = [0], []
        for rel in self.manifest["splits"][split]["shards"]:
            reader = _open_shard(self.path / rel, self.path)
            for b in range(reader.num_record_batches):
                batch = _shard_batch(reader, b, self.path / rel, self.path)
                ids, masks = batch.column(0), batch.column(1)
                self._chunks.append((
                    ids.offsets.to_numpy(),
                    ids.values.to_numpy(zero_copy_only=True),
                    masks.values.to_numpy(zero_copy_only=True),
                    batch.column(3).to_numpy(),
                ))
                lengths.append(batch.column(2).to_numpy())
                starts.append(starts[-1] + batch.num_rows)
        self._starts = np.asarray(starts, dtype=np.int64)
        self.lengths = np.concatenate(lengths).astype(np.int64) if lengths else np.zeros(0, dtype=np.int64)
        self.num_supervised = (np.concatenate([c[3] for c in self._chunks]).astype(np.int64)
                               if self._chunks else np.zeros(0, dtype=np.int64))

    def __len__(self) -> int:
        return len(self.lengths)

    def check_rows(self) -> None:
        """The rows the manifest counts are the rows the shards hold."""
        want = self.manifest["splits"][self.split].get("rows")
        if want is not None and want != len(self):
            raise DamagedFileError(self.path / MANIFEST, f"its {self.split} split counts {want} rows, the shards hold "
                                   f"{len(self)}", _redo(self.path))

    def example(self, i: int) -> Tokenized:
        if not 0 <= i < len(self):
            raise IndexError(f"row {i} out of range for {len(self)} rows")
        c = int(np.searchsorted(self._starts, i, side="right")) - 1
        offsets, ids, masks, _ = self._chunks[c]
        j = i - int(self._starts[c])
        lo, hi = int(offsets[j]), int(offsets[j + 1])
        return Tokenized(ids[lo:hi], masks[lo:hi])
