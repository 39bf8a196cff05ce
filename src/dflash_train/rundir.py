"""The run directory contract: config.yaml, train.log, metrics.jsonl, status.json, checkpoints/,
tensorboard/, export/. Writers here; `read_status` / `format_status` answer `dflash-train status`."""

from __future__ import annotations

import json
import logging
import os
import socket
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

PHASES = ("starting", "loading", "warmup", "training", "exporting", "done", "failed", "stopped")


def write_text_atomic(path: Path, text: str) -> None:
    """Write `text` under a temp name beside `path`, then rename it into place: never a torn file."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def write_json_atomic(path: Path, data: Any) -> None:
    write_text_atomic(path, json.dumps(data, indent=2, sort_keys=True))


@dataclass
class RunDir:
    root: Path

    def __post_init__(self) -> None:
        self.root = Path(self.root)

    @property
    def config(self) -> Path:
        return self.root / "config.yaml"

    @property
    def log(self) -> Path:
        return self.root / "train.log"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def status(self) -> Path:
        return self.root / "status.json"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def tensorboard(self) -> Path:
        return self.root / "tensorboard"

    @property
    def export(self) -> Path:
        return self.root / "export"

    def create(self) -> "RunDir":
        for d in (self.root, self.checkpoints, self.tensorboard):
            d.mkdir(parents=True, exist_ok=True)
        return self

    # train.log rotates: train.log.1 .. .3 keep the previous parts, so a run's log stays bounded.
    log_max_bytes = 64 * 2**20
    log_backups = 3

    def attach_log(self) -> logging.Handler:
        from logging.handlers import RotatingFileHandler

        handler = RotatingFileHandler(self.log, maxBytes=self.log_max_bytes, backupCount=self.log_backups)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        logging.getLogger("dflash_train").addHandler(handler)
        return handler


class StatusWriter:
    """status.json: phase, heartbeat, step, rates, ETA and the last error. Written atomically."""

    def __init__(self, run: RunDir):
        self.run = run
        self.state: dict[str, Any] = {
            "phase": "starting",
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started_at": time.time(),
            "heartbeat": time.time(),
            "step": 0,
            "total_steps": None,
            "error": None,
        }
        self.flush()

    def update(self, **fields: Any) -> None:
        self.state.update(fields)
        self.state["heartbeat"] = time.time()
        self.flush()

    def fail(self, exc: BaseException, phase: Optional[str] = None) -> None:
        self.update(
            phase="failed",
            failed_phase=phase or self.state.get("phase"),
            error={
                "type": type(exc).__name__,
                "message": str(exc),
                "traceback": "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
            },
        )

    def flush(self) -> None:
        write_json_atomic(self.run.status, self.state)


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


class MetricsWriter:
    """metrics.jsonl (one record per log step) and TensorBoard scalars. Both rotate at `max_bytes`:
    metrics.jsonl moves to the next metrics-NNNNN.jsonl and TensorBoard starts a new event file, so
    no file grows without bound and nothing is deleted (the metrics are the run's record)."""

    max_bytes = 64 * 2**20

    def __init__(self, run: RunDir, tensorboard: bool = True):
        self.run, self.path = run, run.metrics
        self.tb = None
        if tensorboard:
            self._open_tensorboard()

    def _open_tensorboard(self) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.tb = SummaryWriter(str(self.run.tensorboard))

    def _rotate(self) -> None:
        if self.path.is_file() and self.path.stat().st_size >= self.max_bytes:
            taken = [int(p.stem.split("-")[1]) for p in self.run.root.glob("metrics-*.jsonl")]
            os.replace(self.path, self.run.root / f"metrics-{max(taken, default=0) + 1:05d}.jsonl")
        if self.tb is not None:
            events = sorted(self.run.tensorboard.glob("events.out.tfevents.*"), key=lambda p: p.stat().st_mtime)
            if events and events[-1].stat().st_size >= self.max_bytes:
                self.tb.close()
                self._open_tensorboard()

    def write(self, record: dict[str, Any]) -> None:
        self._rotate()
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.tb is not None:
            step = record["step"]
            for key, value in record.items():
                if isinstance(value, (int, float)) and key != "step":
                    self.tb.add_scalar(key, value, step)
                elif isinstance(value, list) and key == "accuracy_per_position":
                    for k, v in enumerate(value, start=1):
                        if v is not None:
                            self.tb.add_scalar(f"accuracy_per_position/{k}", v, step)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


def read_status(root: str | Path) -> tuple[dict[str, Any], Optional[dict[str, Any]]]:
    """(status.json, last metrics record or None). Raises FileNotFoundError with a clear message."""
    run = RunDir(Path(root))
    if not run.status.is_file():
        raise FileNotFoundError(f"{run.status} not found: {root} is not a dflash-train run directory (or it never started)")
    status = json.loads(run.status.read_text())
    last = None
    for path in reversed(metrics_parts(run.root)):  # right after a rotation metrics.jsonl may be empty
        last = _last_json_line(path)
        if last is not None:
            break
    return status, last


def _last_json_line(path: Path) -> Optional[dict]:
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        size = f.tell()
        f.seek(max(0, size - 65536))
        lines = f.read().decode("utf-8", errors="replace").strip().splitlines()
    for line in reversed(lines):
        try:
            return json.loads(line)
        except json.JSONDecodeError:
            continue
    return None


def _duration(seconds: Optional[float]) -> str:
    if seconds is None:
        return "-"
    seconds = int(seconds)
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s" if m else f"{s}s"


def format_status(status: dict[str, Any], last: Optional[dict[str, Any]], now: Optional[float] = None) -> str:
    now = time.time() if now is None else now
    step, total = status.get("step", 0), status.get("total_steps")
    lines = [
        f"phase:      {status.get('phase')}" + (f" (in {status['failed_phase']})" if status.get("failed_phase") else ""),
        f"step:       {step}" + (f" / {total}" if total else ""),
        f"heartbeat:  {_duration(now - status['heartbeat'])} ago (pid {status.get('pid')} on {status.get('host')})",
        f"elapsed:    {_duration(status.get('heartbeat', now) - status.get('started_at', now))}",
    ]
    if last:
        acc = last.get("accuracy")
        lines += [
            f"tokens/s:   {last.get('tokens_per_s', 0):,.0f}",
            f"loss:       {last.get('loss', float('nan')):.4f}",
            f"accuracy:   {acc:.3f}" if acc is not None else "accuracy:   -",
            f"tau (est.): {last.get('tau_estimate', float('nan')):.3f}",
            f"lr:         {last.get('lr', 0):.3g}",
        ]
    if status.get("val_tau_estimate") is not None or status.get("val_tau") is not None:
        parts = [f"{k[4:]} {status[k]:.3f}" for k in ("val_tau_walk", "val_tau", "val_tau_estimate", "val_accuracy")
                 if status.get(k) is not None]
        best = status.get("best_val_tau")
        lines.append(f"validation: {', '.join(parts)}" + (f" (best tau {best:.3f}, kept in checkpoints/best)" if best else ""))
    if status.get("skipped_steps"):
        lines.append(f"skipped:    {status['skipped_steps']} steps with non-finite loss or gradients")
    lines.append(f"ETA:        {_duration(status.get('eta_s'))}" if status.get("phase") == "training" else "ETA:        -")
    if status.get("export_dir"):
        lines.append(f"export:     {status['export_dir']}")
    err = status.get("error")
    if err:
        lines.append(f"last error: {err['type']}: {err['message']}")
        lines.append(err.get("traceback", "").rstrip())
    else:
        lines.append("last error: none")
    return "\n".join(lines)


def format_ranks(beats: list[dict[str, Any]], now: Optional[float] = None) -> str:
    """One line per rank (phase, step, heartbeat age, memory, transport waits) and, for a split
    placement, which side limits the run."""
    now = time.time() if now is None else now
    lines = ["ranks:"]
    for b in beats:
        role = f"{b['role']:<9} " if b.get("role") else ""
        line = f"  rank {b['rank']}: {role}{b['phase']:<9} step {b['step']:<7} heartbeat {now - b['time']:.1f} s ago"
        if b.get("mem_gib") is not None:
            line += f"  mem {b['mem_gib']:.1f} GiB"
        if b.get("transport_wait_s") is not None:
            line += f"  waited {b['transport_wait_s']:.1f} s for hidden states"
        if b.get("wait_s") is not None:
            line += f"  idle {b['wait_s']:.1f} s, busy {b.get('busy_s', 0):.1f} s, {b.get('produced', 0)} micro-batches"
        if b.get("error"):
            line += f"  ({b['error']})"
        lines.append(line)
    verdict = bound_side(beats)
    if verdict:
        lines.append(f"bound by:   {verdict}")
    return "\n".join(lines)


def bound_side(beats: list[dict[str, Any]]) -> Optional[str]:
    """Split placement: the drafters waiting for hidden states means the target side is too slow;
    idle targets mean the drafter side is. Based on the shares of time each side waited."""
    drafters = [b for b in beats if b.get("role") == "drafter" and b.get("train_s")]
    targets = [b for b in beats if b.get("role") == "target" and (b.get("busy_s") or b.get("wait_s"))]
    if not drafters or not targets:
        return None
    drafter_wait = max(b.get("transport_wait_s", 0) / b["train_s"] for b in drafters)
    target_idle = min(b.get("wait_s", 0) / (b.get("wait_s", 0) + b.get("busy_s", 0)) for b in targets)
    if drafter_wait > 0.05:
        return f"the target side: drafter ranks wait {100 * drafter_wait:.0f}% of the time (add target ranks)"
    return (f"the drafter side: target ranks idle {100 * target_idle:.0f}% of the time"
            + (" (move a GPU to the drafter side)" if target_idle > 0.25 else ""))
