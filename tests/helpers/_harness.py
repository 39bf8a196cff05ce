"""Shared helpers of the reliability tests (chaos, storage faults, soak): a small CPU training config on the
tiny target, training runs in subprocesses, heartbeat waits, loss comparison. Not a test module."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Optional

import pytest
import yaml

# One thread per process: two gloo ranks on a 2-core CI machine with the default thread count
# oversubscribe the cores and run ~7x slower.
ENV = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")


def write_config(path: Path, target: Path, data: Path, **over) -> Path:
    """The tests/integration/test_distributed.py config; `section__key=value` overrides."""
    cfg = {
        "target": {"path": str(target)},
        "drafter": {"num_draft_layers": 1, "block_size": 4, "attention_backend": "sdpa"},
        "data": {"train_files": [str(data)], "max_length": 256, "token_budget": 512, "max_batch_size": 2},
        "objective": {"max_anchors": 16, "gamma": 4.0},
        "optim": {"lr": 3e-3, "epochs": 10, "warmup_ratio": 0.05},
        "run": {"device": "cpu", "log_every": 1, "save_every": 4, "keep_last": 3, "progress_bar": False},
    }
    for dotted, value in over.items():
        section, key = dotted.split("__")
        cfg.setdefault(section, {})[key] = value
    path.write_text(yaml.safe_dump(cfg))
    return path


def losses(run: Path) -> dict[int, float]:
    out = {}
    from dflash_train.run.metrics import read_metrics

    for r in read_metrics(run):
        if "loss" in r:
            out[r["step"]] = r["loss"]
    return out


def assert_same_losses(ref: dict[int, float], got: dict[int, float], steps: int, rel: float = 1e-6) -> None:
    assert sorted(got) == list(range(1, steps + 1)), sorted(got)
    bad = {s: (ref[s], got[s]) for s in ref if got[s] != pytest.approx(ref[s], rel=rel, abs=1e-7)}
    assert not bad, bad


def launch(args: list[str], log: Path, preexec_fn: Optional[Callable] = None, env: Optional[dict] = None,
           **popen) -> subprocess.Popen:
    with open(log, "ab") as out:  # the child keeps its own copy of the descriptor
        return subprocess.Popen([sys.executable, "-m", "dflash_train", *args], stdout=out,
                                stderr=subprocess.STDOUT, env={**ENV, **(env or {})}, preexec_fn=preexec_fn, **popen)


def run(args: list[str], log: Path, timeout: float = 300, env: Optional[dict] = None) -> int:
    proc = launch(args, log, env=env)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise


def beat(run_dir: Path, rank: int) -> Optional[dict]:
    try:
        return json.loads((run_dir / "heartbeats" / f"rank-{rank}.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None


def wait_until(cond: Callable[[], object], proc: subprocess.Popen, timeout: float, what: str,
               interval: float = 0.02, allow_exit: bool = False):
    deadline = time.time() + timeout
    while time.time() < deadline:
        got = cond()
        if got:
            return got
        if proc.poll() is not None and not allow_exit:
            raise AssertionError(f"the run ended ({proc.returncode}) before {what}")
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def wait_for_step(run_dir: Path, rank: int, step: int, proc: subprocess.Popen, timeout: float = 120) -> dict:
    def reached():
        b = beat(run_dir, rank)
        return b if b and b.get("phase") == "training" and b.get("step", 0) >= step else None
    return wait_until(reached, proc, timeout, f"rank {rank} at step {step}")


# Imported at start-up by every Python process of a run when its folder is on PYTHONPATH: the CPU
# stands in for the GPU in `drafter.compile` (the device check lifted, Dynamo's eager backend: tracing,
# guards and recompiles without inductor), as the in-process compile tests do with monkeypatch.
CPU_DRAFTER_COMPILE = """
import dflash_train.config.validate, dflash_train.architectures.family.model, dflash_train.train.start.rank_checks
dflash_train.config.validate.validate_compile_device = lambda *a: None
dflash_train.train.start.rank_checks.validate_compile_device = lambda *a: None
dflash_train.architectures.family.model.COMPILE_BACKEND = "eager"
"""


def cpu_drafter_compile_env(folder: Path) -> dict:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(CPU_DRAFTER_COMPILE)
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(folder), os.environ.get("PYTHONPATH")]))}


# The same for `target.compile` (the target's decoder layers through Dynamo's eager backend on the CPU), with the
# compile layer's recompile limit set to `limit`; `static`: the target's layers compiled with static shapes, so
# that every new batch shape a target rank captures is a recompile after the warm-up.
CPU_TARGET_COMPILE = """
import dflash_train.config.validate, dflash_train.train.start.rank_checks
import dflash_train.accel.compile as compile_layer, dflash_train.target.capture as target_mod
dflash_train.config.validate.validate_compile_device = lambda *a: None
dflash_train.train.start.rank_checks.validate_compile_device = lambda *a: None
target_mod._COMPILE_DEVICES = ("cuda", "cpu")
target_mod._COMPILE_BACKEND = "eager"
compile_layer.RECOMPILE_LIMIT = {limit}
if {static}:
    _compiled = compile_layer.compiled
    def _static_target(name, fn, **kwargs):
        return _compiled(name, fn, **({{**kwargs, "dynamic": False}} if name.startswith("target_layer") else kwargs))
    compile_layer.compiled = _static_target
"""


def cpu_target_compile_env(folder: Path, limit: int = 64, static: bool = False) -> dict:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(CPU_TARGET_COMPILE.format(limit=limit, static=static))
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(folder), os.environ.get("PYTHONPATH")]))}


def status(run_dir: Path) -> dict:
    return json.loads((run_dir / "status.json").read_text())


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGKILL)
        proc.wait()


def kill_rank_and_time(run_dir: Path, args: list[str], log: Path, wait_rank: int, kill_rank: int,
                       at_step: int = 6, timeout: float = 240) -> tuple[int, float, dict]:
    """Start a run, SIGKILL `kill_rank` once `wait_rank` trains step `at_step`: (the launcher's exit code, seconds
    from the kill to its exit, the run's status)."""
    proc = launch(args, log)
    try:
        wait_for_step(run_dir, wait_rank, at_step, proc, timeout=timeout)
        os.kill(beat(run_dir, kill_rank)["pid"], signal.SIGKILL)
        t0 = time.time()
        rc = proc.wait(timeout=60)
        took = time.time() - t0
    finally:
        stop(proc)
    return rc, took, status(run_dir)
