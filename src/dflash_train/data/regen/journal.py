"""The files a regen run keeps beside its output, so that a killed run continues exactly: finished
records are read back (a torn last line is cut off), the settings it was started with are recorded and
a run with other settings is refused, and the rejects and the summary say what was skipped and why."""

from __future__ import annotations

import json
import logging
import os
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

from ... import __version__
from ...files.io import write_text_atomic
from ..formats import DamagedDataFile

log = logging.getLogger(__name__)

SIDECAR_FORMAT = 1
SHOW_REJECTS = 10  # rejects listed in the summary (all of them are in the rejects file)


class SettingsMismatch(ValueError):
    """The output exists but was produced with other settings."""


def side_paths(out: Path) -> tuple[Path, Path]:
    """(settings sidecar, rejects file) of an output file."""
    return out.with_name(out.name + ".regen.json"), out.with_name(out.name + ".rejects.jsonl")


_ID_PREFIX = b'{"id": '
_DECODER = json.JSONDecoder()


def _line_id(raw: bytes, full: bool) -> tuple[Optional[str], Optional[dict]]:
    """(id, record if `full`) of a complete line, (None, None) if unreadable. Lines this module writes
    start with the id, so a resume reads a huge output fast without decoding whole conversations."""
    try:
        if not full and raw.startswith(_ID_PREFIX):
            rid, _ = _DECODER.raw_decode(raw[len(_ID_PREFIX):].decode("utf-8"))
            return (rid, None) if isinstance(rid, str) else (None, None)
        rec = json.loads(raw)
        return (rec["id"], rec) if isinstance(rec["id"], str) else (None, None)
    except (ValueError, KeyError, TypeError):
        return None, None


def read_done_ids(path: Path, full: bool = False) -> dict[str, Optional[dict]]:
    """Ids of the complete records of a JSONL file this module appends to (-> the record when `full`).
    A torn last line (a write cut short by a kill) is removed from the file; a broken line before the
    last one is an error."""
    ids: dict[str, Optional[dict]] = {}
    if not path.exists():
        return ids
    good_end = 0
    bad: Optional[int] = None  # line number of an unreadable line
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            if bad is not None:
                raise ValueError(f"{path}:{bad} is not a valid record and is not the last line: the file was "
                                 "edited or damaged; repair or remove it")
            rid, rec = _line_id(raw, full) if raw.endswith(b"\n") else (None, None)
            if rid is None:
                bad = lineno
                continue
            ids[rid] = rec
            good_end += len(raw)
    if bad is not None:
        log.warning("%s: dropping a torn last line (line %d, cut short by an interrupted run)", path, bad)
        with open(path, "r+b") as f:
            f.truncate(good_end)
            f.flush()
            os.fsync(f.fileno())
    return ids


class Appender:
    """Appends JSON lines; each `write` is one write call, flushed and fsynced."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.f = open(path, "ab")

    def write(self, records: list[dict]) -> None:
        if not records:
            return
        self.f.write(b"".join(json.dumps(r, ensure_ascii=False).encode("utf-8") + b"\n" for r in records))
        self.f.flush()
        os.fsync(self.f.fileno())

    def close(self) -> None:
        self.f.close()


def check_settings(out: Path, mode: str, settings: dict[str, Any],
                   also_accepted: Optional[dict[str, Any]] = None) -> None:
    """Refuse to extend an output produced with other settings; record the settings otherwise.
    `also_accepted`: per key, a second value an earlier output may hold for the same thing (what an older
    version recorded, e.g. a target's resolved conversion folder where the target's name is recorded now)."""
    also = also_accepted or {}
    sidecar, rejects = side_paths(out)
    has_rows = any(p.exists() and p.stat().st_size > 0 for p in (out, rejects))
    start_over = (f"run with the original settings to continue, or choose another --out (or delete {out}, "
                  f"{sidecar.name} and {rejects.name} to start over)")
    if has_rows:
        if not sidecar.exists():
            raise SettingsMismatch(f"{out} exists but {sidecar} does not, so the settings it was produced with are "
                                   f"unknown; {start_over}")
        try:
            prev = json.loads(sidecar.read_text(encoding="utf-8"))
            prev_mode, prev_settings = prev["mode"], prev["settings"]
        except (ValueError, KeyError, TypeError):
            raise SettingsMismatch(f"{sidecar} is unreadable; {start_over}") from None
        if prev_mode != mode:
            raise SettingsMismatch(f"{out} was produced by {prev_mode!r} (this run is {mode!r}); {start_over}")
        diffs = [f"{k}: {prev_settings.get(k)!r} there, {settings.get(k)!r} now"
                 for k in sorted(set(prev_settings) | set(settings))
                 if prev_settings.get(k) != settings.get(k) and not (k in also and prev_settings.get(k) == also[k])]
        if diffs:
            raise SettingsMismatch(f"{out} was produced with other settings ({'; '.join(diffs)}); {start_over}")
        return
    record = {"format": SIDECAR_FORMAT, "mode": mode, "settings": settings,
              "created": time.strftime("%Y-%m-%dT%H:%M:%S"), "dflash_train": __version__}
    out.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(sidecar, json.dumps(record, indent=1) + "\n")


def reject_record(where: str, reason: str, detail: str = "") -> dict:
    return {"id": where, "reason": reason, "detail": detail}


@dataclass
class Summary:
    out: str = ""
    rejects_file: str = ""
    rows_written: int = 0
    already_done: int = 0
    rejected: Counter = field(default_factory=Counter)
    truncated: Counter = field(default_factory=Counter)
    new_tokens: int = 0
    elapsed_s: float = 0.0
    first_rejects: list = field(default_factory=list)
    extra: dict = field(default_factory=dict)  # batch mode: requests, missing, unmatched, ...
    damaged_files: list = field(default_factory=list)  # --skip-damaged-files: DamagedDataFile.record() of each

    def reject(self, where: str, reason: str, detail: str = "") -> None:
        self.rejected[reason] += 1
        if len(self.first_rejects) < SHOW_REJECTS:
            self.first_rejects.append((where, reason, detail))

    def as_dict(self) -> dict:
        d = asdict(self)
        d["rejected"], d["truncated"] = dict(self.rejected), dict(self.truncated)
        d["tokens_per_s"] = self.new_tokens / self.elapsed_s if self.elapsed_s else 0.0
        d["rows_per_s"] = self.rows_written / self.elapsed_s if self.elapsed_s else 0.0
        return d

    def format(self) -> str:
        def counts(c: Counter) -> str:
            return ", ".join(f"{k}: {v}" for k, v in c.most_common())

        n_rej = sum(self.rejected.values())
        rejected = f"{n_rej} rejected" + (f" ({counts(self.rejected)})" if n_rej else "")
        lines = [f"regen: {self.rows_written} conversations written, {self.already_done} already done, {rejected}"
                 if self.out else f"regen: {rejected}"]
        if self.truncated:
            lines.append(f"  {sum(self.truncated.values())} conversations end early ({counts(self.truncated)}): "
                         "their later user turns are dropped")
        if self.new_tokens:
            d = self.as_dict()
            lines.append(f"  {self.new_tokens} new tokens in {self.elapsed_s:.1f} s: {d['tokens_per_s']:.1f} tokens/s, "
                         f"{d['rows_per_s']:.2f} rows/s")
        for record in self.damaged_files:
            lines.append(f"  {DamagedDataFile.from_record(record).cut_line()}")
        for where, reason, detail in self.first_rejects:
            lines.append(f"  rejected {where}: {reason}" + (f" ({detail})" if detail else ""))
        if n_rej > len(self.first_rejects):
            lines.append(f"  ... and {n_rej - len(self.first_rejects)} more")
        for k, v in self.extra.items():
            if k != "hint":
                lines.append(f"  {k}: {v}")
        if self.out:
            lines.append(f"output: {self.out}" + (f"   rejects: {self.rejects_file}" if n_rej else ""))
        elif n_rej and self.rejects_file:
            lines.append(f"rejects: {self.rejects_file}")
        if self.extra.get("hint"):
            lines.append(self.extra["hint"])
        return "\n".join(lines)


def format_summary(d: dict) -> str:
    """The human summary of a dict returned by `regenerate` or `batch_roundtrip`."""
    s = Summary(out=d["out"], rejects_file=d["rejects_file"], rows_written=d["rows_written"],
                already_done=d["already_done"], rejected=Counter(d["rejected"]), truncated=Counter(d["truncated"]),
                new_tokens=d["new_tokens"], elapsed_s=d["elapsed_s"], first_rejects=d["first_rejects"],
                extra=d["extra"], damaged_files=d.get("damaged_files", []))
    return s.format()
