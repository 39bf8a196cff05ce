"""Child processes of a stage: started one per GPU, stopped at the deadline, their failures reported."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Callable

from .settings import REPO


class ChildFailed(RuntimeError):
    """A stage's child process (regen, a helper, a training, an eval worker) failed; the message names it, its
    exit code and its log's end. The call ends with that message alone (exit 1); the next call runs the stage
    again."""



def child_env(**extra: str) -> dict:
    """This process's environment for a child: unbuffered, with src/ first on PYTHONPATH, plus `extra`."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src")] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.update(extra)
    return env


def visible_gpus(device: str) -> int:
    """GPUs the children may spread over (0 with --device cpu or without CUDA)."""
    import torch

    return torch.cuda.device_count() if device != "cpu" and torch.cuda.is_available() else 0


def gpu_env(env: dict, k: int, gpus: int) -> dict:
    """The k-th child's environment: on GPU k mod `gpus` when there are several (one process per GPU
    context would time-slice)."""
    return dict(env, CUDA_VISIBLE_DEVICES=str(k % gpus)) if gpus > 1 else env


@dataclass
class Child:
    name: str
    proc: subprocess.Popen
    log: IO[bytes]
    log_path: Path

    def tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:] if self.log_path.is_file() else ""


class Children:
    """Processes started together, each writing to its own log file. Leaving the `with` kills any still
    running and closes every log."""

    def __init__(self) -> None:
        self.procs: list[Child] = []

    def start(self, name: str, cmd: list[str], log_path: Path, env: dict, append: bool = False) -> Child:
        log = open(log_path, "ab" if append else "wb")
        child = Child(name, subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO), log, log_path)
        self.procs.append(child)
        return child

    def wait(self, poll_s: float, tick: Callable[[], None]) -> None:
        """Until every process has ended, calling `tick` after each `poll_s` of sleep."""
        while any(c.proc.poll() is None for c in self.procs):
            time.sleep(poll_s)
            tick()

    def __enter__(self) -> "Children":
        return self

    def __exit__(self, *exc) -> None:
        for c in self.procs:
            if c.proc.poll() is None:
                c.proc.kill()
                c.proc.wait()
            c.log.close()


def run_helpers(cmds: list[list[str]], folder: Path, what: str, runner, device: str, log: Callable[[str], None]) -> None:
    """Run these processes at once, one per GPU; raise with a log tail if one fails; Unfinished if the
    deadline passes."""
    from dflash_train.commands.pipeline import Unfinished

    env = child_env(TOKENIZERS_PARALLELISM="false")
    gpus = visible_gpus(device)

    def tick() -> None:
        if runner.remaining() < 0:
            raise Unfinished(f"{what}: the deadline passed; run the same command again")

    with Children() as kids:
        for k, cmd in enumerate(cmds):
            kids.start(f"{what}-{k:02d}", cmd, folder / f"{what}-{k:02d}.log", gpu_env(env, k, gpus))
        kids.wait(1.0, tick)
    for c in kids.procs:
        if c.proc.returncode != 0:
            raise ChildFailed(f"{what} failed (exit {c.proc.returncode}); {c.log_path} ends:\n{c.tail()}")
        log(c.log_path.read_text(errors="replace").strip().splitlines()[-1])


def run_eval_workers(cmds: list[tuple[list[str], Path]], env: dict, runner, device: str,
                     log: Callable[[str], None], announce: str) -> tuple[list[int], bool, float]:
    """Run the eval workers (command, log file) at once, spread over the GPUs. Once the deadline has passed
    they are stopped (SIGTERM, a kill after 20 s; the prompts they finished are kept). Returns (exit codes,
    whether they were stopped, seconds from their start)."""
    gpus = visible_gpus(device)
    stopped = False

    def tick() -> None:
        nonlocal stopped
        if runner.remaining() >= 0 or stopped:
            return
        log("eval: hard deadline passed: stopping workers (finished prompts are kept)")
        stopped = True
        running = [c.proc for c in kids.procs if c.proc.poll() is None]
        for p in running:
            p.send_signal(signal.SIGTERM)
        for p in running:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()

    with Children() as kids:
        for k, (cmd, log_path) in enumerate(cmds):
            kids.start(f"worker-{k:02d}", cmd, log_path, gpu_env(env, k, gpus))
        log(announce)
        t0 = time.time()
        kids.wait(2.0, tick)
    return [c.proc.returncode for c in kids.procs], stopped, time.time() - t0


def run_regen(cmd: list[str], log_path: Path, runner, device: str, log: Callable[[str], None]) -> None:
    """Run `dflash-train regen` (`cmd`) as a child process on one GPU, its output appended to `log_path`; its
    summary goes to `log`. Once the deadline passes it is killed and the stage is Unfinished: regen appends each
    finished batch at once, so the same command continues where it stopped."""
    from dflash_train.commands.pipeline import Unfinished

    def tick() -> None:
        if runner.remaining() < 0:
            raise Unfinished("the deadline passed during regen; run the same command again (it continues)")

    with Children() as kids:
        start = log_path.stat().st_size if log_path.is_file() else 0
        child = kids.start("regen", cmd, log_path, gpu_env(child_env(TOKENIZERS_PARALLELISM="false"), 0,
                                                            visible_gpus(device)), append=True)
        kids.wait(1.0, tick)
    if child.proc.returncode != 0:
        raise ChildFailed(f"regen failed (exit {child.proc.returncode}); {log_path} ends:\n{child.tail()}")
    with open(log_path, "rb") as f:  # this call's output: the summary regen printed last
        f.seek(start)
        lines = f.read().decode(errors="replace").splitlines()
    first = max((i for i, line in enumerate(lines) if line.startswith("regen: ")), default=len(lines))
    for line in lines[first:]:
        log(line)


def count_lines(path: Path) -> int:
    """Lines of a file (0 when it does not exist)."""
    if not path.is_file():
        return 0
    with open(path, "rb") as f:
        return sum(1 for _ in f)


@dataclass
class TrainJob:
    name: str
    run: Path
    cmd: list[str]
    log_path: Path
    env: dict


def run_trainings(jobs: list[TrainJob], runner, stop_margin_s: float, log: Callable[[str], None]) -> dict[str, tuple[int, float]]:
    """Run the training jobs at once. Once the deadline is `stop_margin_s` away, ask each to checkpoint and
    stop (its STOP file; the next call resumes it). Returns each job's (exit code, seconds it ran)."""
    t0 = time.time()
    ended: dict[str, float] = {}
    stopping = False

    def tick() -> None:
        nonlocal stopping
        for c in kids.procs:
            if c.proc.poll() is not None and c.name not in ended:
                ended[c.name] = time.time()
        if not stopping and runner.remaining() < stop_margin_s:
            log("train: deadline near: asking the runs to checkpoint and stop (they resume next call)")
            for job in jobs:
                job.run.mkdir(parents=True, exist_ok=True)
                (job.run / "STOP").touch()
            stopping = True

    with Children() as kids:
        for job in jobs:
            (job.run / "STOP").unlink(missing_ok=True)  # left by an earlier call's deadline: it would end this run at once
            log(f"train {job.name}: " + " ".join(job.cmd))
            kids.start(job.name, job.cmd, job.log_path, job.env, append=True)
        kids.wait(1.0, tick)
    for job in jobs:
        (job.run / "STOP").unlink(missing_ok=True)
    return {c.name: (c.proc.returncode, ended.get(c.name, time.time()) - t0) for c in kids.procs}
