"""Rejected rows, one shape for every reader: `{"where": "file:line", "reason": ..., "detail": ...}`.

`prepare` streams them into its output's `rejects.jsonl`; on-the-fly loading (`train` on raw files)
keeps them and writes them atomically where asked, and logs one summary line per reason with the
first few ids instead of one line per row.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from pathlib import Path
from typing import Optional, TextIO

from ..files.io import write_text_atomic
from .formats import RowError

EXAMPLES = 5  # ids shown per reason in a summary line


def reject_record(where: str, reason: str, detail: str = "") -> dict:
    return {"where": where, "reason": reason, "detail": detail}


def _line(record: dict) -> str:
    return json.dumps(record) + "\n"


class Rejects:
    """Counts per reason, the first EXAMPLES ids of each, and every record: written to `sink` as they come
    when one is given (memory does not grow), else kept in `records` for `write`."""

    def __init__(self, sink: Optional[TextIO] = None):
        self.sink = sink
        self.counts: Counter = Counter()
        self.examples: dict[str, list[str]] = {}
        self.records: list[dict] = []
        self.first: list[dict] = []  # the first EXAMPLES records, any reason

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def add(self, where: str, reason: str, detail: str = "") -> None:
        self.counts[reason] += 1
        ids = self.examples.setdefault(reason, [])
        if len(ids) < EXAMPLES:
            ids.append(where)
        record = reject_record(where, reason, detail)
        if len(self.first) < EXAMPLES:
            self.first.append(record)
        if self.sink is not None:
            self.sink.write(_line(record))
        else:
            self.records.append(record)

    def add_error(self, where: str, error: RowError) -> None:
        self.add(where, error.reason, error.detail)

    def extend(self, other: "Rejects") -> None:
        for record in other.records:
            self.add(record["where"], record["reason"], record["detail"])

    def first_lines(self) -> list[str]:
        """`where: reason (detail)` of the first rejected rows."""
        return [f"{r['where']}: {r['reason']}" + (f" ({r['detail']})" if r["detail"] else "") for r in self.first]

    def summary_lines(self, what: str, rows_read: int) -> list[str]:
        """One line per reason, most frequent first: how many rows of `what` and the first ids."""
        lines = []
        for reason, n in sorted(self.counts.items(), key=lambda kv: (-kv[1], kv[0])):
            ids = ", ".join(self.examples[reason]) + (", ..." if n > len(self.examples[reason]) else "")
            lines.append(f"rejected {n} of {rows_read} rows of {what}: {reason} ({ids})")
        return lines

    def log_summary(self, log: logging.Logger, what: str, rows_read: int, listed_in: Optional[Path]) -> None:
        """The per-reason lines, then where every rejected row is listed (when it is)."""
        if not self.total:
            return
        for line in self.summary_lines(what, rows_read):
            log.warning("%s", line)
        where = f"every one with its reason in {listed_in}" if listed_in else "not written to a file"
        log.warning("rejected %d of %d rows of %s in all; %s", self.total, rows_read, what, where)

    def write(self, path: Path) -> None:
        """All kept records as JSONL at `path`, atomically (an empty file when none was rejected)."""
        write_text_atomic(Path(path), "".join(_line(r) for r in self.records))
