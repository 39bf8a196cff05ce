"""Processes: `train --nproc N` starts N local ranks and supervises them; `--detach` runs in the
background; `stop` asks a run to checkpoint and exit. Any rank's death stops every rank within seconds,
and the run says `failed` with the rank; a rank whose heartbeat stops for `--stall-timeout` seconds is
treated the same way. Exit codes as in `errors.py` (a stopped run: 3).

Under torchrun (several nodes) torchrun's agent does the supervising; the ranks are the same code.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Optional

from ...run import procs
from ...errors import EXIT_DONE, EXIT_FAILED, EXIT_STOPPED, EXIT_USER_ERROR, UserError
from ...run.directory import ENDED, START_UP_PHASES, RunDir, clear_stop_request, request_stop_file
from ...run.status import StatusWriter, read_heartbeats

GRACE_S = 10.0
# The launcher's start time, inherited by its ranks: a STOP file older than it is stale (stop.StopRequest).
LAUNCH_TIME_ENV = "DFLASH_LAUNCH_TIME"
# Set for the process `--detach` starts (not for the ranks it starts in turn).
DETACHED_ENV = "DFLASH_DETACHED"
_STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT}


class StoppedBeforeStart(Exception):
    """A stop request that reached a detached launcher before its run was under way (`run_detached`)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop_all(procs: list[subprocess.Popen], sig: int = signal.SIGTERM) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                p.send_signal(sig)
            except ProcessLookupError:
                pass
    deadline = time.time() + GRACE_S
    for p in procs:
        try:
            p.wait(timeout=max(deadline - time.time(), 0.1))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _mark_failed(run: RunDir, message: str, rank: Optional[int], phase: Optional[str]) -> None:
    """The launcher's verdict names the rank that failed first; what another rank said when it was
    stopped (often a broken collective) is kept as secondary information."""
    writer = StatusWriter.resume_from_file(run)
    status = writer.state
    previous = status.get("error") if status.get("phase") == "failed" else None
    error = {"type": "RankFailure", "message": message, "traceback": ""}
    if previous:
        error["secondary"] = f"{previous.get('type')}: {previous.get('message')}"
        error["traceback"] = previous.get("traceback", "")
    writer.update(phase="failed", failed_phase=phase or status.get("failed_phase") or status.get("phase"),
                  failed_rank=rank, error=error)


def _mark_refused(run: RunDir, rank: int) -> None:
    """A rank refused the start (exit 2). Refused before it wrote a status (its checks need no weights), the record
    is a refused start's, with where the rank's message is: the same command, fixed, may start there again."""
    writer = StatusWriter.resume_from_file(run)
    if writer.state.get("phase") not in (None, "starting"):  # the rank's own status.json says why
        writer.update(failed_rank=rank)
        return
    said = "above (rank 0's output)" if rank == 0 else f"in {run.root / f'rank-{rank}.out'}"
    writer.update(phase="failed", failed_phase="starting", failed_rank=rank, error={
        "type": "RefusedStart", "message": f"rank {rank} refused the start; its message is {said}",
        "user_error": True, "traceback": ""})


def _mark_stopped(run: RunDir, message: str) -> None:
    writer = StatusWriter.resume_from_file(run)
    if writer.state.get("phase") in ENDED:
        return
    writer.update(phase="stopped", checkpoint=None, message=message)


def check_local_ranks(device: str, nproc: int) -> None:
    """`--nproc N` on a GPU machine starts one rank per GPU: more ranks than visible GPUs are refused before any
    starts (each would import torch, then fail on its missing device)."""
    if device == "cpu":
        return
    import torch

    gpus = torch.cuda.device_count()
    if nproc <= gpus or (device == "auto" and gpus == 0):
        return
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    shown = f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else ""
    if not gpus:
        raise UserError(f"--nproc {nproc}: run.device is cuda, but no GPU is visible{shown}; use run.device=cpu or auto")
    raise UserError(f"--nproc {nproc}: one rank per GPU, and {gpus} GPU(s) are visible{shown}; give --nproc {gpus} or "
                    "fewer")


def supervise(child_args: list[str], nproc: int, run_root: Path, stall_timeout: float = 300.0,
              env_extra: Optional[dict] = None, on_admitted: Optional[Callable[[], None]] = None) -> int:
    """Start `nproc` ranks of `python -m dflash_train <child_args>` and watch them until all exit. `on_admitted` is
    called once rank 0 has admitted the start (its status.json is written)."""
    run = RunDir(run_root).create()
    launched_at = float((env_extra or {}).get(LAUNCH_TIME_ENV) or time.time())
    port = free_port()
    procs: list[subprocess.Popen] = []
    # Like torchrun: ranks share the cores instead of each starting one thread per core (2 gloo
    # ranks on 2 cores ran 7x slower oversubscribed).
    threads = os.environ.get("OMP_NUM_THREADS") or str(max(1, (os.cpu_count() or 1) // nproc))
    for rank in range(nproc):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc),
                   LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   DFLASH_SUPERVISED="1", OMP_NUM_THREADS=threads, **(env_extra or {}))
        log = open(run.root / f"rank-{rank}.out", "ab")
        procs.append(subprocess.Popen([sys.executable, "-m", "dflash_train", *child_args], env=env,
                                      stdout=log if rank else None, stderr=log if rank else None))
    forwarded = {"sig": None}

    def forward(signum, _frame):
        forwarded["sig"] = signum
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)  # ranks checkpoint and exit

    old = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    start_up_stop_seen: Optional[float] = None
    try:
        while True:
            codes = [p.poll() for p in procs]
            if forwarded["sig"] is not None and any(c is None for c in codes):
                # A rank that got the signal during start-up exits at once; a rank already training then
                # waits for it in a collective forever. Give the others the grace period, then end them.
                gone = [b for b in read_heartbeats(run) if b.get("phase") == "stopped" and codes[b["rank"]] is not None]
                if gone and start_up_stop_seen is None:
                    start_up_stop_seen = time.time()
                if start_up_stop_seen is not None and time.time() - start_up_stop_seen > GRACE_S:
                    _stop_all(procs, signal.SIGKILL)
                    _mark_stopped(run, f"stopped by signal {forwarded['sig']} while rank(s) "
                                       f"{[b['rank'] for b in gone]} were starting up; nothing to resume from "
                                       "after the last checkpoint")
                    return EXIT_STOPPED
            failed = [(r, c) for r, c in enumerate(codes) if c not in (None, EXIT_DONE, EXIT_STOPPED)]
            if failed and forwarded["sig"] is None:
                rank, code = failed[0]
                if code == EXIT_USER_ERROR:  # the rank said what to fix (status.json, its output): keep that
                    _stop_all(procs)
                    _mark_refused(run, rank)
                    return EXIT_USER_ERROR
                beats = {b["rank"]: b for b in read_heartbeats(run)}
                how = f"killed by signal {-code}" if code < 0 else f"exited with code {code}"
                _stop_all(procs)
                _mark_failed(run, f"rank {rank} {how}; the other ranks were stopped", rank,
                             beats.get(rank, {}).get("phase"))
                return EXIT_FAILED
            if all(c is not None for c in codes):
                if forwarded["sig"] is None:
                    return EXIT_STOPPED if EXIT_STOPPED in codes else EXIT_DONE
                # Stopping: a rank still importing when the signal came dies of it, with nothing to lose.
                bad = [(r, c) for r, c in enumerate(codes) if c not in (EXIT_DONE, EXIT_STOPPED, -signal.SIGTERM)]
                if not bad:
                    _mark_stopped(run, f"stopped by signal {forwarded['sig']} before the run started training")
                    return EXIT_STOPPED
                rank, code = bad[0]
                _mark_failed(run, f"stopped by signal {forwarded['sig']}, but rank {rank} exited with code {code}",
                             rank, None)
                return EXIT_FAILED
            if on_admitted is not None and _written_by_a_rank(run, launched_at):
                on_admitted()
                on_admitted = None
            now = time.time()
            for beat in read_heartbeats(run):
                if beat.get("phase") in ("training", "warmup") and now - beat["time"] > stall_timeout:
                    _stop_all(procs, signal.SIGKILL)
                    _mark_failed(run, f"rank {beat['rank']} made no progress for {now - beat['time']:.0f} s "
                                      f"(stall timeout {stall_timeout:.0f} s) in phase {beat['phase']} at step {beat['step']}",
                                 beat["rank"], beat["phase"])
                    return EXIT_FAILED
            time.sleep(0.2)
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def _written_by_a_rank(run: RunDir, launched_at: float) -> bool:
    """Whether status.json is a rank's of this launch: written after it, by the rank that admitted the start."""
    try:
        status = json.loads(run.status.read_text())
    except (OSError, ValueError):
        return False
    return "detached_start" not in status and float(status.get("started_at") or 0) >= launched_at


def detach(argv: list[str], run_root: Path, env_extra: dict) -> int:
    """Re-run this command in the background, in its own session, all output in the run directory. When it returns,
    status.json says the run is starting, with the new process's PID: `status` and `stop` work at once."""
    run = RunDir(run_root).create()
    out = open(run.root / "launcher.out", "ab")
    args = [a for a in argv if a != "--detach"]
    # A stop that comes before the new process can take it (it is still importing) waits in the signal mask the
    # process inherits, instead of killing it half-started; `run_detached` takes it.
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
    try:
        proc = subprocess.Popen([sys.executable, "-m", "dflash_train", *args], stdout=out, stderr=out,
                                stdin=subprocess.DEVNULL, start_new_session=True,
                                env={**os.environ, **env_extra, DETACHED_ENV: "1"})
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    (run.root / "launcher.pid").write_text(str(proc.pid))
    StatusWriter.for_detached_start(run, proc.pid, float(env_extra[LAUNCH_TIME_ENV]))
    return proc.pid


def is_detached_launcher() -> bool:
    return os.environ.get(DETACHED_ENV) == "1" and "WORLD_SIZE" not in os.environ


def run_detached(run_root: Path, launched_at: float, command: Callable[[], int]) -> int:
    """The detached launcher's `command`. Until the run writes its own status.json, what happens to the start is
    recorded in the record `detach` wrote: a stop (held in the signal mask while this process started) stops it
    cleanly, and a refusal or failure is written there with its message, as the terminal would have shown it."""
    os.environ.pop(DETACHED_ENV, None)  # the ranks it starts are not detached launchers

    def stop(signum: int, _frame) -> None:
        raise StoppedBeforeStart(f"signal {signum} before the run started")

    run = RunDir(run_root)
    previous = {s: signal.signal(s, stop) for s in _STOP_SIGNALS}
    try:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)
        code = command()
    except StoppedBeforeStart as e:
        _end_detached_start(run, launched_at, phase="stopped", checkpoint=None, stopped_in="starting",
                            message=f"{e}: nothing was trained, nothing to checkpoint")
        clear_stop_request(run)
        return EXIT_STOPPED
    except BaseException as e:
        _end_detached_start(run, launched_at, error=e)
        raise
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if code == EXIT_STOPPED:
        _end_detached_start(run, launched_at, phase="stopped", checkpoint=None, stopped_in="starting",
                            message="stopped before the run started: nothing was trained, nothing to checkpoint")
    elif code != EXIT_DONE:
        _end_detached_start(run, launched_at, phase="failed", failed_phase="starting", error={
            "type": "RankFailure", "message": f"the start ended with exit code {code}; see {run.root / 'launcher.out'}",
            "user_error": code == EXIT_USER_ERROR, "traceback": ""})
    return code


def _end_detached_start(run: RunDir, launched_at: float, error: Optional[BaseException] = None, **fields) -> None:
    """The end of a detached start, in its own status.json record (a record the run has replaced is the run's)."""
    writer = StatusWriter.resume_from_file(run)
    if writer.state.get("detached_start") != launched_at or writer.state.get("phase") != "starting":
        return
    if error is not None:
        writer.fail(error, phase="starting")
    else:
        writer.update(**fields)


def request_stop(run_root: Path) -> tuple[int, str]:
    """Ask a live run to checkpoint and exit: a STOP file every rank looks for at step boundaries, plus
    SIGTERM to the launcher (or the single process), but only once it is sure that PID still is the run's
    process (PID and start time, or its command line): a recycled PID is never signalled.
    Returns (exit code, what was done)."""
    run = RunDir(run_root)
    if not run.status.is_file():
        raise FileNotFoundError(f"{run.status} not found: {run_root} is not a run directory")
    status = json.loads(run.status.read_text())
    phase = status.get("phase")
    if phase in ENDED:
        return EXIT_FAILED, f"the run is not running (phase {phase} at step {status.get('step')}); nothing to stop"
    launcher = _launcher_pid(run)
    same = procs.same_process(status)
    if same is None and status.get("host") == socket.gethostname() and status.get("pid"):
        same = procs.runs_in(int(status["pid"]), run.root)  # a record without its start time: the command line
    if launcher is not None and procs.runs_in(launcher, run.root):
        target, how = launcher, f"the launcher (pid {launcher})"
    elif same:
        target, how = int(status["pid"]), f"the run's process (pid {status['pid']})"
    elif same is None:  # another host, or no /proc: the ranks still read the STOP file at step boundaries
        request_stop_file(run)
        return EXIT_DONE, (f"wrote {run.stop_file}: the run (pid {status.get('pid')} on {status.get('host')}, which "
                           "cannot be checked from here) checkpoints and exits at its next step boundary")
    else:
        return EXIT_FAILED, (f"the run is not running: its status says {phase} at step {status.get('step')}, but "
                             f"pid {status.get('pid')} is no longer its process (it died without a word); nothing "
                             "was signalled. Continue it with --resume")
    request_stop_file(run)
    try:
        os.kill(target, signal.SIGTERM)
    except ProcessLookupError:
        return EXIT_DONE, f"wrote {run.stop_file}; {how} ended meanwhile"
    if phase in START_UP_PHASES:
        return EXIT_DONE, f"asked {how} to stop: the run is {phase}, so it stops at once with nothing to checkpoint"
    return EXIT_DONE, f"asked {how} and every rank (STOP file) to checkpoint and exit"


def _launcher_pid(run: RunDir) -> Optional[int]:
    try:
        return int((run.root / "launcher.pid").read_text().strip())
    except (OSError, ValueError):
        return None
