"""Soak: a long CPU run on the tiny target, its resident memory (VmRSS) and open file descriptors sampled
from /proc every few seconds. What must hold:

- flat RSS: the median of the last quarter of the samples is within RSS_TOLERANCE (10%) of the median of
  the second quarter (the first quarter is start-up and warm-up);
- flat fds: the last quarter's median is at most FD_TOLERANCE (+5) above the second quarter's, and the
  maximum is at most +FD_TOLERANCE above the second quarter's median;
- metrics.jsonl grows linearly: exactly one record per log step, records of about constant size;
- checkpoints stay bounded (run.keep_last) with no temp folder left; train.log, metrics.jsonl and
  TensorBoard rotate at 64 MiB per file (tests/unit/train/test_train_run.py checks the rotation), far beyond a
  soak run: the bytes per step are printed.

`pytest -m soak` runs the long one (DFLASH_SOAK_STEPS, default 2000 steps); the default run has a mini
version (250 steps) that checks fds and the metrics file.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

import pytest

from _harness import launch, status, stop, write_config
from dflash_train.files.layout import list_checkpoints

KEEP_LAST = 2

pytestmark = pytest.mark.slow

RSS_TOLERANCE = 0.10
FD_TOLERANCE = 5


def _sample(pid: int) -> tuple[int, int, int]:
    """(VmRSS in kB, open fds, threads) of a live process."""
    rss = threads = 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss = int(line.split()[1])
        elif line.startswith("Threads:"):
            threads = int(line.split()[1])
    return rss, len(os.listdir(f"/proc/{pid}/fd")), threads


def _step(run_dir: Path) -> int:
    try:
        return json.loads((run_dir / "heartbeats" / "rank-0.json").read_text())["step"]
    except (OSError, json.JSONDecodeError, KeyError):
        return 0


def _soak(tmp_path: Path, target: Path, data: Path, steps: int, interval: float) -> dict:
    cfg = write_config(tmp_path / "soak.yaml", target, data, optim__epochs=100_000, run__save_every=max(steps // 8, 1),
                       run__keep_last=KEEP_LAST, run__log_every=1)
    run_dir = tmp_path / "soak"
    proc = launch(["train", str(cfg), "--run-dir", str(run_dir), "--max-steps", str(steps)], tmp_path / "soak.log")
    samples: list[tuple[float, int, int, int, int]] = []  # (time, step, rss kB, fds, threads)
    t0 = time.time()
    try:
        while proc.poll() is None:
            step = _step(run_dir)
            if step >= 1:  # training: start-up is not the steady state
                try:
                    rss, fds, threads = _sample(proc.pid)
                except (OSError, ValueError):
                    break
                samples.append((time.time() - t0, step, rss, fds, threads))
            time.sleep(interval)
        rc = proc.wait(timeout=steps + 120)
    finally:
        stop(proc)
    assert rc == 0, (tmp_path / "soak.log").read_text()[-3000:]
    assert status(run_dir)["phase"] == "done"
    return {"run": run_dir, "samples": samples, "seconds": time.time() - t0}


def _quarters(values: list[float]) -> tuple[float, float, float]:
    n = len(values)
    q2 = values[n // 4: n // 2]
    q4 = values[3 * n // 4:]
    return statistics.median(q2), statistics.median(q4), max(values[n // 4:])


def _report(result: dict, steps: int) -> dict:
    run_dir, samples = result["run"], result["samples"]
    rss = _quarters([s[2] for s in samples])
    fds = _quarters([s[3] for s in samples])
    sizes = {"metrics.jsonl": (run_dir / "metrics.jsonl").stat().st_size,
             "train.log": (run_dir / "train.log").stat().st_size,
             "tensorboard": sum(p.stat().st_size for p in (run_dir / "tensorboard").rglob("*") if p.is_file())}
    n = len(samples)
    by_quarter = [int(statistics.median([x[2] for x in samples[i * n // 4:(i + 1) * n // 4]])) for i in range(4)]
    info = {"steps": steps, "seconds": round(result["seconds"], 1), "samples": len(samples),
            "rss_kB_quarter_medians": by_quarter,
            "rss_kB_q2_median": rss[0], "rss_kB_q4_median": rss[1], "rss_kB_max": rss[2],
            "rss_growth": round(rss[1] / rss[0] - 1, 4), "fds_q2_median": fds[0], "fds_q4_median": fds[1],
            "fds_max": fds[2], "threads_max": max(s[4] for s in samples),
            **{f"{k}_bytes_per_step": round(v / steps, 1) for k, v in sizes.items()}}
    print("\nsoak:", json.dumps(info))
    return info


def _check_files(run_dir: Path, steps: int) -> None:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == list(range(1, steps + 1))
    lengths = sorted(len(line) for line in lines)
    assert lengths[-1] < 2 * lengths[0], (lengths[0], lengths[-1])  # no record grows with the run
    ckpts = list_checkpoints(run_dir / "checkpoints")
    # at least 8 saves (save_every = steps // 8) were made: exactly keep_last survive, the last at the end
    assert len(ckpts) == KEEP_LAST and ckpts[-1].name == f"step-{steps:08d}"
    assert not [p for p in (run_dir / "checkpoints").iterdir() if p.name.startswith(".")]


@pytest.mark.long
def test_soak_mini_open_files_stay_flat(tmp_path, tiny_target_dir, counting_jsonl):
    steps = 150
    result = _soak(tmp_path, tiny_target_dir, counting_jsonl, steps, interval=0.3)
    info = _report(result, steps)
    assert info["samples"] >= 8, info
    assert info["fds_q4_median"] <= info["fds_q2_median"] + FD_TOLERANCE, info
    assert info["fds_max"] <= info["fds_q2_median"] + FD_TOLERANCE, info
    _check_files(result["run"], steps)


@pytest.mark.soak
def test_soak_memory_and_open_files_stay_flat(tmp_path, tiny_target_dir, counting_jsonl):
    steps = int(os.environ.get("DFLASH_SOAK_STEPS", "2000"))
    result = _soak(tmp_path, tiny_target_dir, counting_jsonl, steps, interval=2.0)
    info = _report(result, steps)
    assert info["samples"] >= 20, info
    assert info["rss_kB_q4_median"] <= info["rss_kB_q2_median"] * (1 + RSS_TOLERANCE), info
    assert info["fds_q4_median"] <= info["fds_q2_median"] + FD_TOLERANCE, info
    assert info["fds_max"] <= info["fds_q2_median"] + FD_TOLERANCE, info
    _check_files(result["run"], steps)
