"""`throughput.py --precompile-fanout`: a cold start compiled in parallel by child processes that fill the shared
compile cache, each with its share of the graphs, while the parent builds its models; the parent's warm-up then takes
every graph from the cache.

One process compiles on one thread (rule 1 of the compile layer, src/dflash_train/accel/compile.py), and a cold
compile is mostly single-threaded Python (Dynamo, AOTAutograd, inductor), so a cold first step is the sum of every
graph's compile. Separate processes compile at once: each child runs the same compiled functions on inputs of the same
shapes as the parent's warm-up (so the cache keys are the same), compiles only its share (`compile.restrict_to`),
writes its graphs to the cache directory and exits; the parent waits for them before its first compile. A child that
fails or runs past its time is named in a warning with its log, and the parent compiles what it did not.

Measured on one H200 with 16 cores (docs/results/performance.md): spawned children are slower than one process
compiling everything (each spends ~16 s starting; three compiling at once take 13-17 s each for shares that take 6-10 s
alone); forked children (`Fanout.fork`, no imports) shorten the first step (25.3 s against 36.0 s) but not the start
(63.9 s against 64.5 s to the first step): the compile's CPU work is moved, not removed. The trainer does not use it.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

log = logging.getLogger(__name__)


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    """A child must not outlive a parent that was killed (it would hold a GPU context for nothing)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class Forked:
    """A forked child, with the part of `subprocess.Popen`'s interface that `Fanout` uses."""

    def __init__(self, pid: int):
        self.pid, self.returncode = pid, None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.time() + timeout
        while self.poll() is None:
            if deadline is not None and time.time() >= deadline:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout)
            time.sleep(0.05)
        return self.returncode

    def terminate(self) -> None:
        if self.poll() is None:
            os.kill(self.pid, signal.SIGTERM)

    def kill(self) -> None:
        if self.poll() is None:
            os.kill(self.pid, signal.SIGKILL)


@dataclass
class Child:
    name: str
    process: subprocess.Popen | Forked
    log_path: Path
    started: float
    ended: float | None = None


@dataclass
class Fanout:
    """The precompile children of one process. `start` them, do other work, then `wait` before compiling."""

    children: list[Child] = field(default_factory=list)
    started: float = field(default_factory=time.time)

    @classmethod
    def start(cls, commands: dict[str, Sequence[str]], log_dir: Path, cache_dir: Path,
              workers_each: int, env: dict[str, str] | None = None) -> "Fanout":
        """One child per command (argv lists), sharing `cache_dir`; each gets `workers_each` compile workers
        (the children and the parent share the machine's cores) and writes its output to log_dir/NAME.log. `env`:
        variables to add to this process's environment for the children."""
        log_dir.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **(env or {}), "TORCHINDUCTOR_CACHE_DIR": str(cache_dir),
               "TORCHINDUCTOR_COMPILE_THREADS": str(max(1, workers_each))}
        fan = cls()
        for name, argv in commands.items():
            path = log_dir / f"{name}.log"
            with open(path, "wb") as out:
                process = subprocess.Popen(list(argv), stdout=out, stderr=subprocess.STDOUT, env=env,
                                           stdin=subprocess.DEVNULL,
                                           preexec_fn=_die_with_parent if sys.platform == "linux" else None)
            fan.children.append(Child(name, process, path, time.time()))
        log.info("precompile: %d child process(es) started (%s), %d compile workers each; logs in %s",
                 len(fan.children), ", ".join(commands), workers_each, log_dir)
        return fan

    @classmethod
    def fork(cls, jobs: dict[str, Callable[[], object]], log_dir: Path, cache_dir: Path,
             workers_each: int) -> "Fanout":
        """One forked child per job (a callable), sharing `cache_dir`, each with `workers_each` compile workers and
        its output in log_dir/NAME.log. A fork starts at once with this process's imports (a new process spends
        ~10 s importing torch and transformers); call it before anything initialises CUDA or starts threads."""
        log_dir.mkdir(parents=True, exist_ok=True)
        sys.stdout.flush()
        sys.stderr.flush()
        fan = cls()
        for name, job in jobs.items():
            path = log_dir / f"{name}.log"
            pid = os.fork()
            if pid == 0:  # pragma: no cover - the child; it never returns
                _run_forked(job, path, cache_dir, workers_each)
            fan.children.append(Child(name, Forked(pid), path, time.time()))
        log.info("precompile: %d forked child process(es) (%s), %d compile workers each; logs in %s",
                 len(fan.children), ", ".join(jobs), workers_each, log_dir)
        return fan

    def wait(self, timeout_s: float) -> dict:
        """Wait for every child, at most `timeout_s` in all; stop those still running then. Returns what the
        run's status records: the wait, when each child was seen to end (seconds from the fan-out's start; a child
        that ended before this call counts as ending at it), and the failed ones."""
        t0 = time.time()
        failed: list[str] = []
        running = list(self.children)
        while running:
            for child in list(running):
                rc = child.process.poll()
                if rc is None:
                    continue
                running.remove(child)
                child.ended = time.time()
                if rc != 0:
                    failed.append(child.name)
                    log.warning("precompile child %s failed (exit %s); the warm-up compiles its graphs itself. Its "
                                "log (%s) ends:\n%s", child.name, rc, child.log_path, tail(child.log_path))
            if running and time.time() - t0 >= timeout_s:
                for child in running:
                    self._stop(child)
                    failed.append(child.name)
                    log.warning("precompile child %s ran past %.0f s and was stopped; the warm-up compiles its graphs "
                                "itself (log: %s)", child.name, timeout_s, child.log_path)
                break
            time.sleep(0.05)
        return {"precompile_children": len(self.children), "precompile_wait_s": round(time.time() - t0, 2),
                "precompile_child_s": {c.name: round(c.ended - self.started, 1) for c in self.children
                                       if c.ended is not None},
                "precompile_failed": failed}

    def stop(self) -> None:
        """Stop every child still running (the parent is leaving early)."""
        for child in self.children:
            if child.process.poll() is None:
                self._stop(child)

    @staticmethod
    def _stop(child: Child) -> None:
        child.process.terminate()
        try:
            child.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            child.process.kill()
            child.process.wait()

    def __enter__(self) -> "Fanout":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _run_forked(job: Callable[[], object], log_path: Path, cache_dir: Path, workers_each: int) -> None:
    code = 1
    try:
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        # Python's own streams too: the parent's may not be the file descriptors (a test's capture, a pipe)
        sys.stdout = open(1, "w", buffering=1, closefd=False)
        sys.stderr = open(2, "w", buffering=1, closefd=False)
        _die_with_parent()
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir)
        os.environ["TORCHINDUCTOR_COMPILE_THREADS"] = str(max(1, workers_each))
        if "torch._inductor.config" in sys.modules:  # read at its import, which may have happened before the fork
            sys.modules["torch._inductor.config"].compile_threads = max(1, workers_each)
        job()
        code = 0
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def tail(path: Path, lines: int = 12) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError as e:
        return f"(unreadable: {e})"
    return "\n".join(text.rstrip().splitlines()[-lines:])
