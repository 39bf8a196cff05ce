"""`dflash-train prepare`: conversations in any supported shape -> a prepared (tokenised) dataset.

Streaming from input to shards: rows are read, tokenised with the target's chat template and
written a record batch at a time, so memory does not grow with the input. Bad rows are counted per
reason and written to `rejects.jsonl` with their `file:line`; good rows are never lost. The output is
built in a hidden temp directory beside `--out` and renamed into place when complete.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from tqdm import tqdm

from ..data import store
from ..data.dataset import tokenize_row
from ..data.formats import DamagedDataFile, RowError, builtin_file, expand_source, iter_source
from ..data.label_counts import COUNTS_FILE, LabelCounter, write_counts
from ..data.rejects import Rejects
from ..errors import UserError
from ..files.outputs import check_prepare_out, put_in_place
from ..target.fingerprints import chat_template_fingerprint, chat_template_text, tokenizer_fingerprint

log = logging.getLogger(__name__)


@dataclass
class PrepareConfig:
    max_length: int = 3072
    block_size: int = 16
    val_fraction: float = 0.02
    thinking: Optional[bool] = None
    shard_rows: int = 50_000
    max_samples: int = 0
    overwrite: bool = False
    skip_damaged_files: bool = False  # use the rows before a damaged file's damage instead of stopping

    def __post_init__(self) -> None:  # a config that cannot be prepared fails before the tokenizer loads
        if self.max_length < 2 * self.block_size:
            raise ValueError(f"--max-length {self.max_length} is below 2 * --block-size ({2 * self.block_size})")
        if not 0.0 <= self.val_fraction < 1.0:
            raise ValueError(f"--val-fraction must be in [0, 1), got {self.val_fraction}")


def holdout_key(messages: list[dict]) -> float:
    """A number in [0, 1) from a hash of the conversation's content (not its position or file); it is held
    out when this is below --val-fraction, so the same conversation lands in the same split whatever file
    or shape it comes in."""
    text = json.dumps(messages, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return int.from_bytes(hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()[:8], "big") / 2.0**64


def template_kwargs_for(tokenizer, thinking: Optional[bool]) -> dict:
    """`enable_thinking` goes to the template only when it is given and the template reads it."""
    if thinking is None or "enable_thinking" not in chat_template_text(tokenizer):
        return {}
    return {"enable_thinking": thinking}


def _source_entries(specs: list[str]) -> list[dict]:
    """Each `--data` argument with the files it reads, their sizes and checksums. Raises
    FileNotFoundError (before any work) when one does not exist."""
    entries = []
    for spec in specs:
        expanded = expand_source(spec)
        if isinstance(expanded, str):
            paths = [builtin_file(expanded)]
        else:
            paths = expanded
        entries.append({"data": spec, "builtin": isinstance(expanded, str), "files": [
            {"path": str(p), "size": p.stat().st_size, "sha256": store.file_sha256(p)} for p in paths
        ]})
    return entries


def _missing_parents(out: Path) -> list[Path]:
    """The folders above `out` that do not exist yet (the deepest first): what a failed prepare must remove."""
    missing, folder = [], out.absolute().parent
    while not folder.exists():
        missing.append(folder)
        folder = folder.parent
    return missing


def _tmp_dir(out: Path) -> Path:
    """A fresh hidden temp dir beside `out`; temp dirs of dead prepare processes are removed."""
    out.parent.mkdir(parents=True, exist_ok=True)
    prefix = f".{out.name}.prepare-"
    for stale in out.parent.glob(prefix + "*"):
        try:
            pid = int(stale.name[len(prefix):])
            os.kill(pid, 0)
        except ProcessLookupError:
            shutil.rmtree(stale, ignore_errors=True)
        except (ValueError, PermissionError):
            pass
    tmp = out.parent / f"{prefix}{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    return tmp


def prepare(tokenizer, target: str, data: list[str], out: str | Path, cfg: PrepareConfig,
            progress: bool = False) -> dict:
    """Write a prepared dataset to `out`; returns its manifest."""
    out = Path(out)
    check_prepare_out(out, data, cfg.overwrite)
    sources = _source_entries(data)
    kwargs = template_kwargs_for(tokenizer, cfg.thinking)

    made = _missing_parents(out)
    tmp = _tmp_dir(out)
    try:
        rejects_file = open(tmp / store.REJECTS, "w", encoding="utf-8")
        rejects = Rejects(sink=rejects_file)
        writers = {s: store.ShardWriter(tmp, s, cfg.shard_rows) for s in store.SPLITS}
        labels = LabelCounter(len(tokenizer))  # the train split's label tokens (drafter.draft_vocab_size)
        rows_read = kept = truncated = 0
        damaged: Optional[list] = [] if cfg.skip_damaged_files else None
        tallies: list[_InputTally] = []
        bar = None
        if progress:
            bar = tqdm(desc="prepare", unit="row", dynamic_ncols=True, mininterval=1.0)
        for spec in data:
            tally = _InputTally(spec, damaged_before=len(damaged or ()))
            tallies.append(tally)
            for where, row in iter_source(spec, damaged=damaged):
                if cfg.max_samples and kept >= cfg.max_samples:
                    break
                rows_read += 1
                tally.read += 1
                if bar is not None:
                    bar.update(1)
                try:
                    tok, messages, was_truncated = tokenize_row(tokenizer, row, cfg.max_length, cfg.block_size, kwargs)
                except RowError as e:
                    rejects.add_error(where, e)
                    tally.reject(where, e)
                    continue
                truncated += was_truncated
                kept += 1
                tally.kept += 1
                held_out = cfg.val_fraction > 0 and holdout_key(messages) < cfg.val_fraction
                writers["val" if held_out else "train"].add(tok)
                if not held_out:
                    labels.add(tok)
            if cfg.max_samples and kept >= cfg.max_samples:
                break
        if bar is not None:
            bar.close()
        for e in damaged or ():
            log.warning("%s", e.cut_line())
        rejects_file.close()
        splits = {s: w.close() for s, w in writers.items()}
        if kept == 0:
            raise UserError(
                f"no usable row in {', '.join(data)} ({_read_and_rejected(rows_read, rejects.counts)}"
                + (f"; first rejects: {'; '.join(rejects.first_lines())}" if rejects.total else "")
                + "). Give conversations with assistant turns (run `dflash-train regen` on prompt-only data)"
                + "".join(f". {e.cut_line()}" for e in damaged or ())
            )
        _refuse_unused_inputs(tallies, kept, len(damaged or ()))
        counts = labels.result()
        write_counts(tmp / COUNTS_FILE, counts)
        manifest = {
            "format": store.FORMAT,
            "format_version": store.FORMAT_VERSION,
            "target": str(target),
            "tokenizer_fingerprint": tokenizer_fingerprint(tokenizer),
            "chat_template_fingerprint": chat_template_fingerprint(tokenizer),
            "thinking": cfg.thinking,
            "template_kwargs": kwargs,
            "max_length": cfg.max_length,
            "block_size": cfg.block_size,
            "val_fraction": cfg.val_fraction,
            "max_samples": cfg.max_samples,
            "shard_rows": cfg.shard_rows,
            "sources": sources,
            "counts": {"rows_read": rows_read, "kept": kept, "truncated": truncated,
                       "rejected": dict(sorted(rejects.counts.items())), "rejected_total": sum(rejects.counts.values()),
                       "damaged_files": [e.record() for e in damaged or ()]},
            "splits": splits,
            "rejects_file": store.REJECTS,
            # how often each token id is a label of the train split (the draft vocabulary is chosen from it)
            "label_counts": {"file": COUNTS_FILE, "split": "train", "size": len(counts), "labels": int(counts.sum()),
                             "distinct": int((counts > 0).sum())},
        }
        store.write_json(tmp / store.MANIFEST, manifest)  # last: a directory with a manifest is complete
        moved = put_in_place(tmp, out, cfg.overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        for folder in made:  # a failed prepare leaves no folder it made either
            with contextlib.suppress(OSError):
                folder.rmdir()
        raise
    if moved is not None:
        log.warning("moved the earlier prepared dataset that was in %s aside to %s (--overwrite)", out, moved)
    return manifest


@dataclass
class _InputTally:
    """What one `--data` argument gave: rows read and kept, and its rejects (counted, the first few named)."""

    spec: str
    damaged_before: int  # damaged files skipped before this input was read
    read: int = 0
    kept: int = 0
    reasons: Counter = field(default_factory=Counter)
    first: list[str] = field(default_factory=list)

    def reject(self, where: str, e: RowError) -> None:
        self.reasons[e.reason] += 1
        if len(self.first) < 2:
            self.first.append(f"{where}: {e}")


def _read_and_rejected(read: int, reasons: Counter) -> str:
    if not read:
        return "0 rows read: it holds none"
    return f"{read} read; rejected: " + ", ".join(f"{r}: {n}" for r, n in reasons.most_common())


def _refuse_unused_inputs(tallies: list[_InputTally], kept: int, damaged: int) -> None:
    """An input that gave no usable row while the others did is refused, naming it: an input one names and that
    adds nothing is a wrong file or a step left out (prompt-only rows need regen), and a warning among the counts
    is easily missed. An input cut off by --max-samples, or left out as --skip-damaged-files asked, is not."""
    unused = []
    for i, t in enumerate(tallies):
        skipped = (tallies[i + 1].damaged_before if i + 1 < len(tallies) else damaged) > t.damaged_before
        if not t.kept and not (skipped and not t.read):
            unused.append(t)
    if not unused:
        return
    named = "; ".join(f"--data {t.spec} gave no usable row ({_read_and_rejected(t.read, t.reasons)}"
                      + (f"; first: {'; '.join(t.first)}" if t.first else "") + ")" for t in unused)
    it = "it" if len(unused) == 1 else "them"
    raise UserError(f"{named}. The other inputs gave {kept} rows. Fix {it} (prompt-only rows: run `dflash-train regen` "
                    f"first) or leave {it} out of --data; nothing was written")


def summary(manifest: dict, out: Path) -> str:
    c, s = manifest["counts"], manifest["splits"]
    lines = [
        f"prepared {out}: {c['kept']} of {c['rows_read']} rows kept ({c['truncated']} truncated to {manifest['max_length']} tokens)",
        f"  train: {s['train']['rows']} rows, {s['train']['tokens']} tokens ({s['train']['supervised_tokens']} supervised), "
        f"{len(s['train']['shards'])} shard(s)",
        f"  val:   {s['val']['rows']} rows, {s['val']['tokens']} tokens ({s['val']['supervised_tokens']} supervised), "
        f"{len(s['val']['shards'])} shard(s)",
    ]
    counts = manifest.get("label_counts")
    if counts:
        lines.append(f"  labels: {counts['distinct']} distinct tokens among the train split's {counts['labels']} "
                     f"(counted in {counts['file']}, for drafter.draft_vocab_size)")
    for d in c.get("damaged_files", ()):
        lines.append(f"  {DamagedDataFile.from_record(d).cut_line()}")
    if c["rejected_total"]:
        lines.append(f"  rejected {c['rejected_total']} rows:")
        for reason, n in sorted(c["rejected"].items(), key=lambda kv: (-kv[1], kv[0])):
            lines.append(f"    {n:>8}  {reason}")
        lines.append(f"  rejects (file:line and reason for each): {out / store.REJECTS}")
    else:
        lines.append("  no row rejected")
    lines.append(f"  tokenizer {manifest['tokenizer_fingerprint'][:19]}..., chat template "
                 f"{manifest['chat_template_fingerprint'][:19]}...")
    return "\n".join(lines)
