"""status.json and the heartbeats: what phase a run is in, and whether the process behind it is still
there (`liveness`); `read_status` / `format_status` / `format_ranks` answer `dflash-train status`."""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Optional

from ..errors import debug_enabled, is_user_error
from ..files.io import write_json_atomic, write_text_atomic
from . import procs
from .directory import ENDED, RunDir
from .metrics import metrics_parts

# A live rank touches its heartbeat file and status.json every PULSE_S seconds (a thread, whatever the
# main thread is doing: loading, compiling, training); a run whose files are older than SILENT_S
# seconds has lost its process.
PULSE_S = 2.0
SILENT_S = 15.0


class StatusWriter:
    """status.json: phase, heartbeat, step, rates, ETA and the last error. Written atomically."""

    def __init__(self, run: RunDir):
        self.run = run
        now = time.time()
        self.state: dict[str, Any] = {
            "phase": "starting",
            **procs.identity(),
            "started_at": now,
            "phase_since": now,
            "heartbeat": now,
            "step": 0,
            "total_steps": None,
            "error": None,
        }
        self.flush()

    def update(self, **fields: Any) -> None:
        now = time.time()
        if "phase" in fields and fields["phase"] != self.state.get("phase"):
            self.state["phase_since"] = now
        self.state.update(fields)
        self.state["heartbeat"] = now
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

    @classmethod
    def for_detached_start(cls, run: RunDir, pid: int, launched_at: float) -> "StatusWriter":
        """status.json of a `--detach`ed start from the moment the command returns: phase starting, the process
        `pid` that will run it (its liveness, `stop`'s target), and `launched_at`, which marks the record as that
        start's own until the run writes its status."""
        writer = cls.__new__(cls)
        writer.run = run
        writer.state = {"phase": "starting", "pid": pid, "pid_start": procs.start_ticks(pid),
                        "host": procs.identity()["host"], "started_at": launched_at, "phase_since": launched_at,
                        "heartbeat": time.time(), "step": 0, "total_steps": None, "error": None,
                        "detached_start": launched_at}
        writer.flush()
        return writer



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


# The phases that report no progress while they last (a warm-up compiles for minutes): `status` says what they do
# and for how long, and takes the heartbeat from the pulse that touches status.json.
QUIET_PHASES = {"starting": "importing and checking the start", "loading": "loading the target and the drafter",
                "warmup": "compiling and running the plan's batch shapes", "exporting": "writing and checking the export"}


def format_status(status: dict[str, Any], last: Optional[dict[str, Any]], now: Optional[float] = None) -> str:
    now = time.time() if now is None else now
    step, total = status.get("step", 0), status.get("total_steps")
    shown, why = run_verdict(status, now)
    live = shown not in (*ENDED, "dead", "silent")
    beat = status["heartbeat"]
    never_began = "detached_start" in status  # the record --detach wrote: the run never took it over
    if shown in ("dead", "silent"):
        head = (f"phase:      {shown} (was {status.get('phase')}: {why}; last heartbeat "
                f"{_duration(now - beat)} ago at step {step}; "
                f"{'run the same command again' if never_began else 'continue with --resume'})")
    elif live and shown in QUIET_PHASES:
        since = status.get("phase_since") or beat
        head = f"phase:      {shown} ({QUIET_PHASES[shown]}, {_duration(now - since)} so far)"
        beat = max(beat, status.get("alive_at") or beat)  # the pulse: nothing else is written while it lasts
    else:
        head = f"phase:      {shown}" + (f" (in {status['failed_phase']})" if status.get("failed_phase") else "")
    lines = [
        head,
        f"step:       {step}" + (f" / {total}" if total else ""),
        f"heartbeat:  {_duration(now - beat)} ago (pid {status.get('pid')} on {status.get('host')})",
        f"elapsed:    {_duration((now if live else status.get('heartbeat', now)) - status.get('started_at', now))}",
    ]
    if last:
        acc = last.get("accuracy")
        lines += [
            f"tokens/s:   {last.get('tokens_per_s', 0):,.0f}",
            *_efficiency_lines(last),
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
    if status.get("checkpoint_error"):
        lines.append(f"checkpoint: a save failed, training went on: {status['checkpoint_error']}")
    lines.append(f"ETA:        {_duration(status.get('eta_s'))}" if shown == "training" else "ETA:        -")
    if status.get("export_dir"):
        lines.append(f"export:     {status['export_dir']}")
    if shown == "stopped" and status.get("checkpoint"):
        lines.append(f"stopped:    checkpoint {status['checkpoint']}; continue it with train --resume")
    elif shown == "stopped" and status.get("message"):
        lines.append(f"stopped:    {status['message']}")
    err = status.get("error")
    if err:
        lines.append(f"last error: {err['type']}: {err['message']}")
        if not err.get("user_error") or debug_enabled():  # a user's mistake is its one line, as the command said it
            lines.append(err.get("traceback", "").rstrip())
    elif shown in ("dead", "silent"):
        lines.append("last error: none recorded: the process ended without a word (SIGKILL, the OOM killer, "
                     "a lost node)" + ("" if never_began else "; its last checkpoint is intact"))
    else:
        lines.append("last error: none")
    return "\n".join(lines)


def _efficiency_lines(last: dict[str, Any]) -> list[str]:
    """The last record's model FLOPs a step, MFU and drafted blocks per second (rank 0's GPU; train/loop/flops.py)."""
    if last.get("step_flops") is None:
        return []
    line = (f"efficiency: {last['step_flops'] / 1e12:,.3g} TFLOP a step (target {last['target_flops'] / 1e12:,.3g}, "
            f"drafter {last['drafter_flops'] / 1e12:,.3g})")
    if last.get("mfu") is not None:
        line += (f", MFU {100 * last['mfu']:.1f}% of {last['mfu_peak_tflops']:g} TFLOP/s (target "
                 f"{100 * last['target_mfu']:.1f}%, drafter {100 * last['drafter_mfu']:.1f}%)")
    else:
        line += ", MFU - (no peak for this device: run.mfu_peak_tflops)"
    return [line, f"blocks/s:   {last['drafted_blocks_per_s']:,.0f} drafted"]


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
        if phase in QUIET_PHASES:  # `time` is when the phase began; the pulse says the rank is at it
            beat = max(b["time"], b.get("alive_at") or b["time"])
            line = (f"  rank {b['rank']}: {role}{phase:<9} step {b['step']:<7} heartbeat {now - beat:.1f} s ago "
                    f"({phase} for {_duration(now - b['time'])})")
        else:
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

