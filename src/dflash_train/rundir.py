"""The run directory contract: config.yaml, train.log, metrics.jsonl, status.json, heartbeats/, STOP,
checkpoints/, tensorboard/, export/ (and, with run.report_to, trackers.json, mlruns/, wandb/). Writers here;
`read_status` / `format_status` answer `dflash-train status`, and `liveness` says whether the process behind
a run is still there."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import string
import threading
import time
import traceback
from dataclasses import dataclass
from logging.handlers import RotatingFileHandler
from pathlib import Path
from typing import Any, Optional, Protocol, Sequence
from urllib.parse import urlparse

from . import procs
from .errors import is_user_error
from .layout import list_checkpoints, move_aside
from .runtime import publish, write_json_atomic, write_text_atomic
from .trackers import TRACKERS

log = logging.getLogger(__name__)

PHASES = ("starting", "loading", "warmup", "training", "exporting", "done", "failed", "stopped")
ENDED = ("done", "failed", "stopped")
START_UP_PHASES = ("starting", "loading", "warmup")
# A live rank touches its heartbeat file and status.json every PULSE_S seconds (a thread, whatever the
# main thread is doing: loading, compiling, training); a run whose files are older than SILENT_S
# seconds has lost its process.
PULSE_S = 2.0
SILENT_S = 15.0
# The names a start writes into its run directory (fnmatch patterns): all that a refused start's trace can hold.
START_ENTRIES = ("status.json", "config.yaml", "train.log*", "metrics*.jsonl", "checkpoints", "tensorboard",
                 "heartbeats", "export", "rejects*.jsonl", "resumes.jsonl", "trackers.json", "mlruns", "wandb",
                 "launcher.out", "launcher.pid", "rank-*.out", "STOP", "dflash_train.json")


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

    @property
    def trackers(self) -> Path:
        """trackers.json: the run id each tracker of run.report_to gave this run (a resume continues it)."""
        return self.root / "trackers.json"

    @property
    def mlruns(self) -> Path:
        return self.root / "mlruns"

    @property
    def stop_file(self) -> Path:
        return self.root / "STOP"

    @property
    def heartbeats(self) -> Path:
        return self.root / "heartbeats"

    def contents(self) -> list[str]:
        """What in this directory belongs to a run, described for a message; empty: nothing to lose."""
        found = []
        if self.status.is_file():
            try:
                st = json.loads(self.status.read_text())
                found.append(f"a run {st.get('phase')} at step {st.get('step')} (status.json)")
            except (OSError, json.JSONDecodeError):
                found.append("status.json")
        found += [name for name in ("config.yaml", "metrics.jsonl") if (self.root / name).is_file()]
        ckpts = list_checkpoints(self.checkpoints)
        if ckpts:
            found.append(f"{len(ckpts)} checkpoint(s), newest {ckpts[-1].name}")
        if (self.checkpoints / "best").is_dir():
            found.append("checkpoints/best")
        if self.export.is_dir() and any(self.export.iterdir()):
            found.append("export/ (an exported drafter)")
        return found

    def move_aside(self) -> Path:
        """Rename the directory to a free `NAME.old-YYYYmmdd-HHMMSS[-k]` beside it (never deletes)."""
        return move_aside(self.root)

    def holds_only_a_refused_start(self) -> bool:
        """True when what is here is the trace of a start that failed on a user error before its first checkpoint
        (status.json says failed, with the error marked as the user's, and nothing was trained): the same command,
        fixed, may start here again, and the trace goes."""
        try:
            status = json.loads(self.status.read_text())
        except (OSError, json.JSONDecodeError):
            return False
        error = status.get("error") if isinstance(status, dict) else None
        return (status.get("phase") == "failed" and isinstance(error, dict) and error.get("user_error") is True
                and status.get("failed_phase") in START_UP_PHASES and not status.get("step")
                and not list_checkpoints(self.checkpoints) and not (self.checkpoints / "best").exists()
                and not (self.export.is_dir() and any(self.export.iterdir())))

    def remove_start_trace(self, kept: Optional[frozenset[str]] = None, keep_root: bool = False) -> list[str]:
        """Delete what a start wrote here, and the directory itself when nothing else is left (unless `keep_root`:
        it was there before). Only for `holds_only_a_refused_start()`. `kept`: the names that were here before the
        start (all else is its); None: unknown, so only START_ENTRIES go. Returns the names removed."""
        import fnmatch
        import shutil

        removed = []
        for entry in sorted(self.root.iterdir()) if self.root.is_dir() else []:
            ours = (entry.name not in kept) if kept is not None else \
                any(fnmatch.fnmatchcase(entry.name, pattern) for pattern in START_ENTRIES)
            if not ours:
                continue
            shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
            removed.append(entry.name)
        if not keep_root and self.root.is_dir() and not any(self.root.iterdir()):
            self.root.rmdir()
        return removed

    def create(self) -> "RunDir":
        for d in (self.root, self.checkpoints, self.tensorboard):
            d.mkdir(parents=True, exist_ok=True)
        return self

    # train.log rotates: train.log.1 .. .3 keep the previous parts, so a run's log stays bounded.
    log_max_bytes = 64 * 2**20
    log_backups = 3

    def attach_log(self) -> logging.Handler:
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
            **procs.identity(),
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
                "user_error": is_user_error(exc),  # the message says what to fix; nothing else went wrong
                "traceback": "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
            },
        )

    @classmethod
    def resume_from_file(cls, run: RunDir) -> "StatusWriter":
        """A writer over the status.json another process wrote (the launcher's verdict on its ranks)."""
        writer = cls.__new__(cls)
        writer.run = run
        writer.state = json.loads(run.status.read_text()) if run.status.is_file() else {"step": 0}
        return writer

    def flush(self) -> None:
        write_json_atomic(self.run.status, self.state)


# ---------------------------------------------------------------------------- heartbeats and liveness


def heartbeat_path(run: RunDir, rank: int) -> Path:
    return run.heartbeats / f"rank-{rank}.json"


def write_heartbeat(run: RunDir, rank: int, phase: str, step: int, **extra) -> None:
    """heartbeats/rank-K.json: the rank's phase and step, and `time`, when it last made progress."""
    path = heartbeat_path(run, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps({"rank": rank, **procs.identity(), "phase": phase, "step": step,
                                        "time": time.time(), **extra}))


def read_heartbeats(run: RunDir) -> list[dict]:
    beats = []
    for path in sorted(run.heartbeats.glob("rank-*.json")) if run.heartbeats.is_dir() else []:
        try:
            beat = json.loads(path.read_text())
            beat["alive_at"] = path.stat().st_mtime
            beats.append(beat)
        except (OSError, json.JSONDecodeError):
            continue
    return beats


class Pulse:
    """A thread that touches this rank's heartbeat file (and, on rank 0, status.json) every PULSE_S
    seconds: their modification time says the process is alive, while their `time` / `heartbeat` fields
    keep saying when it last made progress. It only sets file times: no content, no compiled code."""

    def __init__(self, paths: list[Path], interval: float = PULSE_S):
        self.paths, self.interval = paths, interval
        self._halt = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dflash-pulse", daemon=True)

    def start(self) -> "Pulse":
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._halt.wait(self.interval):
            for path in self.paths:
                with contextlib.suppress(OSError):  # not written yet, or being replaced this instant
                    os.utime(path)

    def stop(self) -> None:
        self._halt.set()
        self._thread.join(timeout=self.interval + 1)


def liveness(record: dict, alive_at: Optional[float], now: Optional[float] = None) -> tuple[str, str]:
    """("alive" | "dead" | "silent" | "unknown", why) for the process behind a status or heartbeat record
    of a run that has not ended. Same host: asked of the kernel, exactly (PID and start time). Else: by the
    age of the file the process touches every PULSE_S seconds."""
    now = time.time() if now is None else now
    same = procs.same_process(record)
    if same is True:
        return "alive", f"pid {record.get('pid')} is running"
    if same is False:
        return "dead", f"pid {record.get('pid')} on {record.get('host')} is gone"
    if alive_at is None:
        return "unknown", "no heartbeat file"
    age = now - alive_at
    if age > SILENT_S:
        return "silent", (f"no sign of life for {_duration(age)} from pid {record.get('pid')} on "
                          f"{record.get('host')} (it touches its files every {PULSE_S:.0f} s)")
    return "alive", f"alive {age:.0f} s ago"


# ---------------------------------------------------------------------------- stop requests


def request_stop_file(run: RunDir) -> None:
    write_text_atomic(run.stop_file, f"{time.time()}\n")


def stop_requested_since(run: RunDir, since: float) -> bool:
    """A STOP file written at or after `since` (the time this start began): an older one is stale, left by
    a run that died before consuming it, and never stops a later start."""
    try:
        text = run.stop_file.read_text().strip()
        written = float(text) if text else run.stop_file.stat().st_mtime
    except FileNotFoundError:
        return False
    except (OSError, ValueError):
        written = run.stop_file.stat().st_mtime if run.stop_file.exists() else 0.0
    return written >= since


def clear_stop_request(run: RunDir) -> None:
    run.stop_file.unlink(missing_ok=True)


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
            publish(self.path, self.run.root / f"metrics-{max(taken, default=0) + 1:05d}.jsonl")
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


# ---------------------------------------------------------------------------- trackers (run.report_to)


class Tracker(Protocol):
    """One experiment tracker's run, continued across resumes: it takes every metrics record's scalars."""

    def write(self, step: int, scalars: dict[str, float]) -> None: ...

    def close(self, failed: bool = False) -> None: ...


def read_tracker_ids(run: RunDir) -> dict[str, dict[str, Any]]:
    """trackers.json: {tracker: {what identifies its run}}; empty when there is none (or it is unreadable)."""
    try:
        data = json.loads(run.trackers.read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def _save_tracker_id(run: RunDir, name: str, entry: dict[str, Any]) -> None:
    ids = read_tracker_ids(run)
    ids[name] = entry
    write_json_atomic(run.trackers, ids)


def open_tracker(name: str, run: RunDir, params: dict[str, Any]) -> Tracker:
    if name == "mlflow":
        return MlflowTracker(run, params)
    if name == "wandb":
        return WandbTracker(run, params)
    raise ValueError(f"unknown tracker {name!r} (valid: {', '.join(TRACKERS)})")


class MlflowTracker:
    """An MLflow run through MlflowClient (explicit run id, no fluent global state). The tracking URI is
    MLFLOW_TRACKING_URI when set, else a local file store in RUN/mlruns; the experiment is
    MLFLOW_EXPERIMENT_NAME or "dflash-train", the run is named after the run directory."""

    def __init__(self, run: RunDir, params: dict[str, Any]):
        from mlflow.entities import Param
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient

        self.uri = os.environ.get("MLFLOW_TRACKING_URI") or run.mlruns.resolve().as_uri()
        if _is_file_store(self.uri):
            # MLflow 3 keeps its file store in maintenance mode and refuses to open one without this opt-in;
            # it needs no database (the sqlite store needs sqlalchemy and alembic, which mlflow-skinny lacks).
            # Set for this process only, and only for a file store; a value the user set is kept.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(tracking_uri=self.uri)
        known = read_tracker_ids(run).get("mlflow", {}).get("run_id")
        self.run_id: Optional[str] = None
        if known:
            try:
                active = self.client.get_run(known).info.lifecycle_stage == "active"
            except MlflowException as e:
                if e.error_code != "RESOURCE_DOES_NOT_EXIST":
                    raise
                active = False
            if active:
                self.run_id = known
                self.client.update_run(known, status="RUNNING")
            else:
                log.warning("MLflow run %s of %s is not in %s (or was deleted); starting a new MLflow run",
                            known, run.trackers, self.uri)
        if self.run_id is None:
            name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or "dflash-train"
            experiment = self.client.get_experiment_by_name(name)
            experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(name)
            created = self.client.create_run(experiment_id, run_name=run.root.name,
                                             tags={"dflash_train.run_dir": str(run.root.resolve())})
            self.run_id = created.info.run_id
            _save_tracker_id(run, "mlflow", {"run_id": self.run_id, "experiment_id": experiment_id,
                                             "tracking_uri": self.uri})
            items = [Param(k, str(v)) for k, v in sorted(params.items())]
            for i in range(0, len(items), 100):  # MLflow takes at most 100 params per batch
                self.client.log_batch(self.run_id, params=items[i:i + 100])

    def write(self, step: int, scalars: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(k, float(v), now, step) for k, v in scalars.items()]
        for i in range(0, len(metrics), 1000):  # MLflow takes at most 1000 metrics per batch
            self.client.log_batch(self.run_id, metrics=metrics[i:i + 1000])

    def close(self, failed: bool = False) -> None:
        self.client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")


def _is_file_store(uri: str) -> bool:
    """A local path or file: URI (a bare name such as "databricks" also passes: the opt-in is then unused)."""
    return urlparse(uri).scheme in ("", "file")


class WandbTracker:
    """A Weights & Biases run, offline unless WANDB_MODE says otherwise: it writes RUN/wandb/offline-run-*/
    and needs no network or account (`wandb sync RUN/wandb/offline-run-*` uploads it later). The project
    is WANDB_PROJECT or "dflash-train"; the run id is kept in trackers.json, so a resume logs into the
    same run (each sitting writes its own offline-run-* directory under that id)."""

    def __init__(self, run: RunDir, params: dict[str, Any]):
        import wandb

        run_id = read_tracker_ids(run).get("wandb", {}).get("id")
        fresh = run_id is None
        if fresh:
            run_id = "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(12))
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT") or "dflash-train",
            name=run.root.name,
            id=run_id,
            resume="allow",
            dir=str(run.root),
            mode=os.environ.get("WANDB_MODE") or "offline",
            config=params if fresh else None,  # the params once per tracker run
            settings=wandb.Settings(console="off", silent=True),  # leave the trainer's stdout/stderr alone
        )
        if fresh:
            _save_tracker_id(run, "wandb", {"id": run_id})

    def write(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log(dict(scalars), step=step)

    def close(self, failed: bool = False) -> None:
        import wandb

        self.run.finish(exit_code=1 if failed else 0)
        # finish() can return before W&B's service process has written the run's file (offline, on a busy
        # machine: an empty run-ID.wandb for a while); teardown waits for it, so the run is on disk when
        # close returns. W&B's own atexit teardown is, by its docs, unreliable in multi-process programs.
        wandb.teardown()


def read_status(root: str | Path) -> tuple[dict[str, Any], Optional[dict[str, Any]]]:
    """(status.json, last metrics record or None). Raises FileNotFoundError with a clear message; status.json
    gains `alive_at`, the time its writer last touched it."""
    run = RunDir(Path(root))
    if not run.status.is_file():
        hint = ""
        launcher_out = run.root / "launcher.out"
        if launcher_out.is_file():
            tail = [line for line in launcher_out.read_text(errors="replace").splitlines() if line.strip()][-1:]
            hint = f"; the launcher's last words ({launcher_out}): {tail[0]}" if tail else ""
        raise FileNotFoundError(f"{run.status} not found: {root} is not a dflash-train run directory "
                                f"(or its run never started){hint}")
    status = json.loads(run.status.read_text())
    status["alive_at"] = run.status.stat().st_mtime
    last = None
    for path in reversed(metrics_parts(run.root)):  # right after a rotation metrics.jsonl may be empty
        last = _last_json_line(path)
        if last is not None:
            break
    return status, last


def run_verdict(status: dict[str, Any], now: Optional[float] = None) -> tuple[str, str]:
    """The phase `status` should show and why: an ended run's own phase; a run whose process is gone,
    "dead"; one whose process cannot be asked and has been silent past SILENT_S, "silent"."""
    phase = status.get("phase")
    if phase in ENDED:
        return phase, ""
    alive, why = liveness(status, status.get("alive_at"), now)
    if alive in ("dead", "silent"):
        return alive, why
    return phase, ""


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
    shown, why = run_verdict(status, now)
    if shown in ("dead", "silent"):
        head = (f"phase:      {shown} (was {status.get('phase')}: {why}; last heartbeat "
                f"{_duration(now - status['heartbeat'])} ago at step {step}; continue with --resume)")
    else:
        head = f"phase:      {shown}" + (f" (in {status['failed_phase']})" if status.get("failed_phase") else "")
    lines = [
        head,
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
    lines.append(f"ETA:        {_duration(status.get('eta_s'))}" if shown == "training" else "ETA:        -")
    if status.get("export_dir"):
        lines.append(f"export:     {status['export_dir']}")
    err = status.get("error")
    if err:
        lines.append(f"last error: {err['type']}: {err['message']}")
        lines.append(err.get("traceback", "").rstrip())
    elif shown in ("dead", "silent"):
        lines.append("last error: none recorded: the process ended without a word (SIGKILL, the OOM killer, "
                     "a lost node); its last checkpoint is intact")
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
        phase = b["phase"]
        if phase not in ENDED:
            alive, _ = liveness(b, b.get("alive_at"), now)
            phase = alive if alive in ("dead", "silent") else phase
        line = f"  rank {b['rank']}: {role}{phase:<9} step {b['step']:<7} heartbeat {now - b['time']:.1f} s ago"
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
