"""`Reporter`: one rank's voice in the run directory."""

from __future__ import annotations

import logging
from typing import Any, Optional, Sequence

from .directory import RunDir
from .metrics import MetricsWriter
from .status import Pulse, StatusWriter, heartbeat_path, write_heartbeat


class Reporter:
    """One rank's voice in the run directory: its heartbeat file and the pulse that says the process lives,
    and on rank 0 status.json, train.log, metrics.jsonl, TensorBoard and the trackers of run.report_to.
    Nothing else writes them."""

    def __init__(self, run: RunDir, rank: int, is_main: bool):
        self.run, self.rank, self.is_main = run, rank, is_main
        self.phase, self.step = "starting", 0
        self.beat_fields: dict[str, Any] = {}  # repeated in every heartbeat of this rank: role, memory, ...
        self.log_handler = run.attach_log() if is_main else None
        self.status = StatusWriter(run) if is_main else None
        self.metrics: Optional[MetricsWriter] = None
        self.has_failed = False
        self.pulse = Pulse([heartbeat_path(run, rank)] + ([run.status] if is_main else [])).start()

    def report(self, **fields: Any) -> None:
        """Status fields (rank 0); a new phase or step also goes into this rank's heartbeat."""
        if self.status is not None:
            self.status.update(**fields)
        if "phase" in fields or "step" in fields:
            self.phase, self.step = fields.get("phase", self.phase), fields.get("step", self.step)
            write_heartbeat(self.run, self.rank, self.phase, self.step, **self.beat_fields)

    def beat(self, step: int, phase: str = "training", **extra: Any) -> None:
        """This rank's progress, with its standing fields and `extra`; status.json is left alone."""
        self.step = step
        write_heartbeat(self.run, self.rank, phase, step, **{**self.beat_fields, **extra})

    def open_metrics(self, trackers: Sequence[str] = (), params: Optional[dict[str, Any]] = None) -> None:
        """metrics.jsonl and TensorBoard, and `trackers` (run.report_to) with `params` (the flattened config)."""
        if self.is_main and self.metrics is None:
            self.metrics = MetricsWriter(self.run, trackers=trackers, params=params)

    def write_metrics(self, record: dict[str, Any]) -> None:
        if self.metrics is not None:
            self.metrics.write(record)

    def stopped_during_start_up(self, reason: BaseException) -> None:
        if self.status is not None:
            self.status.update(phase="stopped", checkpoint=None, stopped_in=self.phase,
                               message=f"{reason}: nothing was trained, nothing to checkpoint")
        write_heartbeat(self.run, self.rank, "stopped", self.step)

    def failed(self, e: BaseException) -> None:
        self.has_failed = True
        if self.status is not None:
            self.status.fail(e)
        else:
            write_heartbeat(self.run, self.rank, "failed", self.step, error=f"{type(e).__name__}: {e}")

    def close(self) -> None:
        self.pulse.stop()
        if self.metrics is not None:
            self.metrics.close(failed=self.has_failed)
        if self.log_handler is not None:
            logging.getLogger("dflash_train").removeHandler(self.log_handler)
            self.log_handler.close()
