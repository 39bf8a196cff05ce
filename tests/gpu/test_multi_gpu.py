"""GPU tests (`pytest -m gpu`, on the device machine): split, FSDP and TP over NCCL."""

import json
import math
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

from _gpu_helpers import _fresh_dynamo_per_test, _gpu_config  # noqa: F401 (the autouse Dynamo reset)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]



@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_split_over_nccl_matches_one_gpu_resumes_and_fails_fast(tmp_path, tiny_target_dir, counting_jsonl):
    """1 target GPU + 1 drafter GPU: the losses of a one-GPU run; SIGTERM checkpoints and --resume
    finishes with the same losses; a killed target rank fails the run within seconds."""
    import os
    import signal
    import time

    from _harness import beat, launch, losses, run, status, stop, wait_for_step

    cfg = _gpu_config(tmp_path / "c.yaml", tiny_target_dir, counting_jsonl)
    one = tmp_path / "one"
    assert run(["train", str(cfg), "--run-dir", str(one), "--max-steps", "12"], tmp_path / "one.log") == 0
    split_args = ["train", str(cfg), "parallel.placement=split", "--max-steps", "12", "--nproc", "2"]
    out, log = tmp_path / "split", tmp_path / "split.log"
    proc = launch(split_args + ["--run-dir", str(out)], log)
    try:
        wait_for_step(out, 0, 5, proc, timeout=300)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 3, log.read_text()[-3000:]  # stopped before done
    finally:
        stop(proc)
    st = status(out)
    assert st["phase"] == "stopped" and st["checkpoint"], st
    assert run(split_args + ["--run-dir", str(out), "--resume"], log) == 0, log.read_text()[-3000:]
    ref, got = losses(one), losses(out)
    assert sorted(got) == list(range(1, 13))
    # bf16 on two GPUs of the same kind: the same kernels, so equal up to reduction-order noise
    assert all(abs(got[s] - ref[s]) <= 2e-2 * abs(ref[s]) for s in ref), (ref, got)
    beats = {r: beat(out, r) for r in (0, 1)}
    assert beats[1]["mem_gib"] > 0
    last = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["transport_wait_s"] >= 0 and last["peak_mem_gib"] > 0

    out, log = tmp_path / "kill", tmp_path / "kill.log"
    proc = launch(["train", str(cfg), "parallel.placement=split", "--max-steps", "2000", "--nproc", "2",
                   "--run-dir", str(out)], log)
    try:
        wait_for_step(out, 0, 3, proc, timeout=300)
        os.kill(beat(out, 1)["pid"], signal.SIGKILL)
        t0 = time.time()
        rc = proc.wait(timeout=120)
        took = time.time() - t0
    finally:
        stop(proc)
    st = status(out)
    assert rc != 0 and took < 30 and st["phase"] == "failed" and st["failed_rank"] == 1, (rc, took, st)



@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_colocated_ranks_with_compiled_drafter_and_fresh_shared_cache(tmp_path, tiny_target_dir, counting_jsonl):
    """DDP over two colocated GPU ranks with drafter.compile and target.compile: both ranks clear the shared
    compile cache at once (--fresh-compile-cache), compile, train without recompiling, and the losses are
    those of the same run with eager layers (the compiled graphs feed DDP's gradient averaging alike)."""
    from _harness import losses, run

    cfg = _gpu_config(tmp_path / "c.yaml", tiny_target_dir, counting_jsonl,
                      compile_cache_dir=str(tmp_path / "cache"))
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "stale").write_text("x")
    base = ["train", str(cfg), "target.compile=true", "--max-steps", "10", "--nproc", "2"]
    compiled, eager = tmp_path / "compiled", tmp_path / "eager"
    log = tmp_path / "train.log"
    assert run(base + ["drafter.compile=true", "--fresh-compile-cache", "--run-dir", str(compiled)], log) == 0, \
        log.read_text()[-3000:]
    assert not (tmp_path / "cache" / "stale").exists()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("cache")) == ["cache"]
    status = json.loads((compiled / "status.json").read_text())
    assert status["phase"] == "done" and status["drafter_compiled_graphs"] > 0, status
    records = [json.loads(line) for line in (compiled / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["recompiles"] == records[0]["recompiles"]
    assert run(base + ["drafter.compile=false", "--run-dir", str(eager)], log) == 0, log.read_text()[-3000:]
    ref, got = losses(eager), losses(compiled)
    assert sorted(got) == sorted(ref) == list(range(1, 11))
    assert all(abs(got[s] - ref[s]) <= 5e-2 * abs(ref[s]) for s in ref), (ref, got)



@pytest.mark.parametrize("sharding", ["fsdp", "tp"])
def test_sharded_with_one_rank_trains_the_losses_of_none(tmp_path, tiny_target_dir, counting_jsonl, sharding):
    """`target.sharding: fsdp | tp` on one GPU (a shard group of one over NCCL): the losses of the unsharded run
    (the same weights, kernels and shapes; bit-identical on CPU, here within 1e-3 should a gathered buffer's
    alignment pick another matmul kernel)."""
    from _harness import losses, run

    cfg = _gpu_config(tmp_path / "c.yaml", tiny_target_dir, counting_jsonl)
    plain, sharded = tmp_path / "none", tmp_path / sharding
    assert run(["train", str(cfg), "--run-dir", str(plain), "--max-steps", "12"], tmp_path / "none.log") == 0
    assert run(["train", str(cfg), f"target.sharding={sharding}", "--run-dir", str(sharded), "--max-steps", "12"],
               tmp_path / "sharded.log") == 0, (tmp_path / "sharded.log").read_text()[-3000:]
    ref, got = losses(plain), losses(sharded)
    assert sorted(got) == list(range(1, 13)) and all(abs(got[s] - ref[s]) <= 1e-3 * abs(ref[s]) for s in ref), (ref, got)
    assert json.loads((sharded / "status.json").read_text())["target_shard_ranks"] == 1



@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_fsdp_over_two_gpus_trains_the_losses_of_unsharded(tmp_path, tiny_target_dir, counting_jsonl):
    """Two colocated ranks, the target sharded over both (NCCL all-gathers, prefetched): the losses of the same
    two ranks with the whole target on each."""
    from _harness import losses, run

    cfg = _gpu_config(tmp_path / "c.yaml", tiny_target_dir, counting_jsonl)
    plain, sharded = tmp_path / "none", tmp_path / "fsdp"
    assert run(["train", str(cfg), "--run-dir", str(plain), "--max-steps", "12", "--nproc", "2"],
               tmp_path / "none.log") == 0
    assert run(["train", str(cfg), "target.sharding=fsdp", "--run-dir", str(sharded), "--max-steps", "12",
                "--nproc", "2"], tmp_path / "fsdp.log") == 0, (tmp_path / "fsdp.log").read_text()[-3000:]
    ref, got = losses(plain), losses(sharded)
    assert sorted(got) == list(range(1, 13)) and all(abs(got[s] - ref[s]) <= 1e-3 * abs(ref[s]) for s in ref), (ref, got)

