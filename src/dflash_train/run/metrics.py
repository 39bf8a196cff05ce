"""metrics.jsonl (rotated into metrics-NNNNN.jsonl parts), TensorBoard, and the trackers of run.report_to:
the run's record, one line per log step."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Optional, Sequence

from ..files.io import replace_file, write_text_atomic
from .directory import RunDir
from .tracker_runs import Tracker, open_tracker

log = logging.getLogger(__name__)


def metrics_parts(root: str | Path) -> list[Path]:
    """The run's metrics files in order: rotated parts (metrics-00001.jsonl, ...), then metrics.jsonl."""
    root = Path(root)
    parts = sorted(root.glob("metrics-*.jsonl"))
    return parts + ([root / "metrics.jsonl"] if (root / "metrics.jsonl").is_file() else [])


def read_metrics(root: str | Path) -> list[dict[str, Any]]:
    """Every metrics record of a run, oldest first, across rotated parts (a torn line is skipped)."""
    records = []
    for path in metrics_parts(root):
        for line in path.read_text().splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return records


def truncate_metrics(path: Path, step: int) -> None:
    """A resumed run re-logs the steps after its checkpoint: drop the killed run's records of them,
    newest file first, across rotated parts (a part left empty is removed)."""
    for part in reversed(metrics_parts(path.parent)):
        lines = part.read_text().splitlines()
        keep = []
        for line in lines:
            try:
                if json.loads(line)["step"] <= step:
                    keep.append(line)
            except (json.JSONDecodeError, KeyError):
                continue  # a torn last line from the kill
        if len(keep) == len(lines):
            break  # this part, and every older one, ends at or before the checkpoint
        if not keep and part != path:
            part.unlink()
            continue
        write_text_atomic(part, "".join(line + "\n" for line in keep))  # a kill leaves the old file
        if keep:
            break


def record_scalars(record: dict[str, Any]) -> dict[str, float]:
    """The scalars of a metrics record, named as every sink shows them: each number but `step`, and
    accuracy_per_position as accuracy_per_position/1 .. /k (slots with nothing counted left out)."""
    out: dict[str, float] = {}
    for key, value in record.items():
        if isinstance(value, (int, float)) and key != "step":
            out[key] = value
        elif isinstance(value, list) and key == "accuracy_per_position":
            for k, v in enumerate(value, start=1):
                if v is not None:
                    out[f"accuracy_per_position/{k}"] = v
    return out


class MetricsWriter:
    """metrics.jsonl (one record per log step), TensorBoard scalars and the trackers of run.report_to.
    metrics.jsonl and TensorBoard rotate at `max_bytes`: metrics.jsonl moves to the next metrics-NNNNN.jsonl
    and TensorBoard starts a new event file, so no file grows without bound and nothing is deleted (the
    metrics are the run's record). `params` (the flattened config) go to each tracker run once."""

    max_bytes = 64 * 2**20

    def __init__(self, run: RunDir, tensorboard: bool = True, trackers: Sequence[str] = (),
                 params: Optional[dict[str, Any]] = None):
        self.run, self.path = run, run.metrics
        self.tb = None
        if tensorboard:
            self._open_tensorboard()
        self.trackers: list[Tracker] = []
        try:
            for name in trackers:
                self.trackers.append(open_tracker(name, run, params or {}))
        except BaseException:
            self.close(failed=True)
            raise

    def _open_tensorboard(self) -> None:
        from torch.utils.tensorboard import SummaryWriter  # here: `status` imports this module, torch takes 1.7 s

        self.tb = SummaryWriter(str(self.run.tensorboard))

    def _rotate(self) -> None:
        if self.path.is_file() and self.path.stat().st_size >= self.max_bytes:
            taken = [int(p.stem.split("-")[1]) for p in self.run.root.glob("metrics-*.jsonl")]
            replace_file(self.path, self.run.root / f"metrics-{max(taken, default=0) + 1:05d}.jsonl")
        if self.tb is not None:
            events = sorted(self.run.tensorboard.glob("events.out.tfevents.*"), key=lambda p: p.stat().st_mtime)
            if events and events[-1].stat().st_size >= self.max_bytes:
                self.tb.close()
                self._open_tensorboard()

    def write(self, record: dict[str, Any]) -> None:
        self._rotate()
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        scalars = record_scalars(record)
        step = record["step"]
        if self.tb is not None:
            for key, value in scalars.items():
                self.tb.add_scalar(key, value, step)
        for tracker in self.trackers:
            tracker.write(step, scalars)

    def close(self, failed: bool = False) -> None:
        """Flush and close every sink; `failed`: the run ended in an error (trackers mark their run so)."""
        if self.tb is not None:
            self.tb.close()
        trackers, self.trackers = self.trackers, []
        for tracker in trackers:
            try:
                tracker.close(failed)
            except Exception as e:  # cleanup (often in a `finally`): the run's own error, if any, goes on
                log.warning("%s did not close cleanly: %s: %s", type(tracker).__name__, type(e).__name__, e)
