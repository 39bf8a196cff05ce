"""Is the process that wrote a run's status still that process? A PID alone is not an identity: the
kernel recycles it. (PID, start time) is, on Linux, where /proc says both; elsewhere we cannot tell
and say so instead of guessing."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Optional

PROC = Path("/proc")


def start_ticks(pid: int) -> Optional[int]:
    """When process `pid` started, in clock ticks since boot (field 22 of /proc/PID/stat); None when
    there is no such process or no /proc."""
    try:
        stat = (PROC / str(pid) / "stat").read_text()
    except (OSError, ValueError):
        return None
    # The command name (field 2) is in parentheses and may hold spaces or ')': split after the last one.
    fields = stat[stat.rindex(")") + 2:].split()
    if fields and fields[0] in ("Z", "X"):  # a zombie (dead, not yet reaped) or dying: not running
        return None
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return None


def identity() -> dict:
    """This process, as status.json and the heartbeats record it."""
    return {"pid": os.getpid(), "pid_start": start_ticks(os.getpid()), "host": socket.gethostname()}


def can_check() -> bool:
    return PROC.is_dir() and start_ticks(os.getpid()) is not None


def same_process(record: dict) -> Optional[bool]:
    """Whether the process that wrote `record` (pid, pid_start, host) is alive and is still that process.
    None: it cannot be told from here (another host, an old record without pid_start, no /proc)."""
    pid, started, host = record.get("pid"), record.get("pid_start"), record.get("host")
    if not pid or host != socket.gethostname() or not can_check():
        return None
    now = start_ticks(int(pid))
    if now is None:
        return False  # no such process
    if started is None:
        return None
    return now == int(started)


def command_line(pid: int) -> Optional[list[str]]:
    try:
        raw = (PROC / str(pid) / "cmdline").read_bytes()
    except OSError:
        return None
    return [a.decode(errors="replace") for a in raw.split(b"\0") if a]


def runs_in(pid: int, run_root: Path) -> Optional[bool]:
    """Whether `pid` is a `dflash-train train` process of the run directory `run_root` (its command line
    names the module and, resolved against its working directory, that --run-dir). None without /proc."""
    if not can_check():
        return None
    argv = command_line(pid)
    if not argv:
        return False
    if not any(a == "dflash_train" or a.endswith("dflash-train") for a in argv[:3]) or "train" not in argv:
        return False
    try:
        cwd = Path(os.readlink(PROC / str(pid) / "cwd"))
    except OSError:
        return False
    for flag, value in zip(argv, argv[1:]):
        if flag == "--run-dir":
            return (cwd / value).resolve() == Path(run_root).resolve()
    for a in argv:
        if a.startswith("--run-dir="):
            return (cwd / a.split("=", 1)[1]).resolve() == Path(run_root).resolve()
    return False
