"""GPU tests (`pytest -m gpu`, on the device machine): the compiled drafter and inductor's caches."""

import json
import math
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

from _gpu_helpers import _fresh_dynamo_per_test, _drafter_and_inputs, _run, _rel  # noqa: F401 (the autouse Dynamo reset)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]



@pytest.mark.parametrize("seed", [0, 1])
def test_compiled_drafter_layers_match_eager(seed):
    """drafter.compile through inductor, flex attention, bf16 autocast: the compiled layers' rounding error
    against the float32 eager result is no worse than the eager bf16 layers' own (twice it at most)."""
    import copy

    torch.backends.cuda.matmul.allow_tf32 = False
    drafter, *rest = _drafter_and_inputs(seed=seed)
    compiled = copy.deepcopy(drafter)
    compiled.compile_layers()
    ref_out, ref_grads = _run(drafter, *rest, "sdpa", torch.float32)
    e_out, e_grads = _run(drafter, *rest, "flex", torch.bfloat16)
    c_out, c_grads = _run(compiled, *rest, "flex", torch.bfloat16, compiled_layers=True)
    assert _rel(c_out, ref_out) < 2 * _rel(e_out, ref_out) + 1e-3
    for k in ref_grads:
        assert _rel(c_grads[k], ref_grads[k]) < 2 * _rel(e_grads[k], ref_grads[k]) + 1e-2, k



def test_a_warm_start_takes_every_bf16_graph_from_aotautograds_cache(tmp_path):
    """Two benchmark processes, one compile cache: the second compiles nothing anew, and AOTAutograd's cache
    serves every graph (the target's layer, both drafter layer graphs, flex attention forward and backward, the CE
    chunk) with no bypass. On the CPU the drafter graphs bypassed while RMSNorm turned autocast off inside them;
    here the GPU's own graphs (flex attention) are checked as well."""
    from pathlib import Path

    script = Path(__file__).parents[2] / "benchmarks" / "throughput.py"
    cmd = [sys.executable, str(script), "--shape", "tiny", "--batch", "2", "--seq", "512", "--block", "16",
           "--anchors", "16", "--layers", "2", "--repeat", "1", "--compile-target", "--compile-drafter",
           "--cache-dir", str(tmp_path / "cache")]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2] / "src")}
    lines = []
    for _ in range(2):
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        lines.append(json.loads([line for line in done.stdout.splitlines() if line.startswith("{")][-1]))
    cold, warm = lines
    assert cold["fxgraph_cache_miss"] > 0 and cold["aot_cache_bypass"] == 0, cold
    assert warm["fxgraph_cache_miss"] == 0 and warm["aot_cache_miss"] == 0, warm
    assert warm["aot_cache_bypass"] == 0 and warm["aot_cache_hit"] >= 4, warm



def test_compile_workers_start_before_any_compile(tmp_path):
    """start_compile_workers (called as a GPU rank starts, before its weights load): inductor's worker pool
    is up and ready before anything compiles, so the first compile does not build kernels one at a time."""
    code = textwrap.dedent("""
        import sys, time
        from dflash_train.accel import compile as compile_layer
        from torch._inductor.async_compile import AsyncCompile
        from torch._dynamo.utils import counters
        compile_layer.configure_cache(sys.argv[1])
        compile_layer.start_compile_workers()
        assert AsyncCompile.process_pool.cache_info().currsize == 1, "no pool"
        deadline = time.time() + 120
        while not AsyncCompile.use_process_pool():
            assert time.time() < deadline, "pool not ready in 120 s"
            time.sleep(0.2)
        assert counters["stats"]["unique_graphs"] == 0
        print("ready")
    """)
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "cache")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ready", out.stderr[-3000:]



def test_inductor_recompiles_a_kernel_whose_elements_cross_two_to_the_31(caplog):
    """The premise of train/plan/indexing.py: inductor indexes a kernel that fits 2^31 - 1 elements with 32-bit
    integers and guards the dynamic sizes to stay there, so the first call past it recompiles (a run refuses
    such a plan up front)."""
    import logging

    from dflash_train.accel import compile as compile_layer

    compile_layer.watch_recompiles()
    torch._dynamo.reset()
    fn = compile_layer.compiled("test_int32_indexing", lambda x: x + 1, dynamic=True)
    fn(torch.zeros(4099, 1024, dtype=torch.int8, device="cuda"))
    before = compile_layer.recompiles()
    fn(torch.zeros(8191, 1024, dtype=torch.int8, device="cuda"))  # same side of 2^31: the same graph
    assert compile_layer.recompiles() == before
    with caplog.at_level(logging.WARNING, logger="dflash_train"):
        big = fn(torch.zeros(2**21 + 3, 1024, dtype=torch.int8, device="cuda"))  # 2^31 + 3072 elements
    assert int(big[-1, -1]) == 1
    assert compile_layer.recompiles() == before + 1
    assert "2147483647" in caplog.text, caplog.text  # the failed guard: numel <= 2^31 - 1
    del big
    torch._dynamo.reset()

