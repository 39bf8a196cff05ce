"""`drafter.compile` on CPU: the config key and its refusal on a CPU device, the compiled layers against the
eager ones (outputs and gradients, AOTAutograd's joint graph as inductor gets it), two graphs shared by all
layers that no later batch size or length recompiles (no duck sizing), and the trainer's warm-up covering
batches of one row and of several. Inductor numerics and speed are checked on a GPU (tests/gpu/,
benchmarks/throughput.py --compile-drafter)."""

import copy
import json
import logging
import re
from pathlib import Path

import pytest
import torch

from dflash_train.config.load import config_from_dict, load_config
from dflash_train.errors import ConfigError
from dflash_train.accel import compile as compile_layer
from dflash_train.architectures.family import model as drafter_mod
from dflash_train.architectures.attention import DrafterKVCache, sdpa_attention
from dflash_train.architectures.dflash.model import DFlashDrafter
from dflash_train.architectures.family.config import make_drafter_config
from dflash_train.architectures.family.mask import dense_mask

H, BS = 64, 4


def _drafter(layers=3, seed=0) -> DFlashDrafter:
    from transformers import Qwen3Config

    tcfg = Qwen3Config(hidden_size=H, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, vocab_size=1000)
    torch.manual_seed(seed)
    return DFlashDrafter(make_drafter_config(tcfg, num_draft_layers=layers, block_size=BS, target_layer_ids=[1, 5],
                                             mask_token_id=3))


def _inputs(b: int, s: int, n_blocks: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(b, s, 2 * H, generator=g)
    embeds = torch.randn(b, n_blocks * BS, H, generator=g)
    anchors = torch.stack([torch.randperm(s - BS, generator=g)[:n_blocks].sort().values for _ in range(b)])
    keep = torch.rand(b, n_blocks, generator=g) > 0.2
    block_pos = (anchors.unsqueeze(-1) + torch.arange(BS)).view(b, -1)
    position_ids = torch.cat([torch.arange(s).expand(b, s), block_pos], dim=1)
    return hidden, embeds, position_ids, dense_mask(anchors, keep, s, BS)


def _loss_and_grads(drafter, inputs, compiled: bool, dtype=None):
    drafter.zero_grad(set_to_none=True)
    ctx = torch.autocast("cpu", dtype=dtype) if dtype else torch.autocast("cpu", enabled=False)
    with ctx:
        out = drafter(*inputs[:3], sdpa_attention, inputs[3], compiled_layers=compiled)
    loss = out.float().pow(2).mean()
    loss.backward()
    return out.detach().float(), {n: p.grad.clone() for n, p in drafter.named_parameters()}


# ------------------------------------------------------------------------------------------ config


def test_key_is_off_by_default_and_refused_on_cpu():
    assert config_from_dict({}).drafter.compile is False
    assert load_config(None, ["drafter.compile=true", "run.device=cuda"]).drafter.compile is True
    with pytest.raises(ConfigError, match=r"'drafter.compile'.*CUDA.*cpu.*drafter.compile=false"):
        load_config(None, ["drafter.compile=true", "run.device=cpu"])


def test_compiled_layers_need_compile_layers_and_no_cache():
    drafter = _drafter()
    inputs = _inputs(2, 24, 3)
    with pytest.raises(ValueError, match="compile_layers"):
        drafter(*inputs[:3], sdpa_attention, inputs[3], compiled_layers=True)
    drafter.compile_layers(backend="eager")
    with pytest.raises(ValueError, match="KV cache"):
        drafter(*inputs[:3], sdpa_attention, inputs[3], cache=DrafterKVCache(3), compiled_layers=True)


# ------------------------------------------------------------------------------------------ numerics


def test_compiled_layers_match_eager_outputs_and_gradients(fresh_dynamo):
    """aot_eager: Dynamo's graph through AOTAutograd's joint forward/backward (what inductor compiles), run
    by eager kernels, in float32 (tight). bf16 autocast with inductor is checked on the GPU."""
    dtype = None
    eager = _drafter()
    compiled = copy.deepcopy(eager)
    compiled.compile_layers(backend="aot_eager")
    inputs = _inputs(2, 40, 5)
    out_e, grads_e = _loss_and_grads(eager, inputs, compiled=False, dtype=dtype)
    out_c, grads_c = _loss_and_grads(compiled, inputs, compiled=True, dtype=dtype)
    tol = dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out_c, out_e, **tol)
    assert grads_c.keys() == grads_e.keys()
    for name in grads_e:
        torch.testing.assert_close(grads_c[name], grads_e[name], **tol, msg=lambda m: f"{name}: {m}")
    assert any(g.abs().sum() > 0 for g in grads_c.values())


def test_the_compiled_layers_hold_no_autocast_context_and_bf16_stays_bf16(fresh_dynamo):
    """Under bf16 autocast (as training runs them) the two layer graphs Dynamo captures carry no autocast
    enter/exit: AOTAutograd's cache refuses a graph with one ("Unsupported call_function target
    _enter_autocast"), and every start traced the drafter's joint graphs again (measured: 6 s of a warm start on
    the CPU). The norms still return bf16 under autocast, and equal the eager layers'."""
    from torch.amp import autocast_mode

    graphs = []

    def recorder(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    eager = _drafter(layers=2)
    compiled = copy.deepcopy(eager)
    compiled.compile_layers(backend=recorder)
    inputs = _inputs(2, 24, 4)
    out_e, grads_e = _loss_and_grads(eager, inputs, compiled=False, dtype=torch.bfloat16)
    out_c, grads_c = _loss_and_grads(compiled, inputs, compiled=True, dtype=torch.bfloat16)
    assert graphs
    targets = [node.target for gm in graphs for node in gm.graph.nodes if node.op == "call_function"]
    assert not {autocast_mode._enter_autocast, autocast_mode._exit_autocast} & set(targets)
    assert torch.ops.aten._fused_rms_norm.default in targets or torch.ops.aten._fused_rms_norm in targets
    torch.testing.assert_close(out_c, out_e, rtol=0, atol=0)
    norm = eager.layers[0].input_layernorm
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert norm(torch.randn(3, H, dtype=torch.bfloat16)).dtype == torch.bfloat16


# ------------------------------------------------------------------------------------------ graphs


def test_two_graphs_for_all_layers_and_no_recompile_across_shapes(fresh_dynamo):
    """Warm with a batch of several rows whose block part is exactly as long as its context (duck sizing
    would tie the two lengths) and with one row; then other batch sizes and lengths compile nothing."""
    drafter = _drafter(layers=3)
    drafter.compile_layers(backend="eager")
    before = compile_layer.graphs_compiled()
    for b, s, n in ((2, 24, 6), (1, 36, 4)):  # 6 blocks x 4 = 24 = the context length
        _loss_and_grads(drafter, _inputs(b, s, n), compiled=True)
    warmed = compile_layer.graphs_compiled() - before
    # (inputs, output + MLP) x (several rows, one row) x (the first layer, whose input needs no gradient;
    # the later layers): for all three layers. the objective gives the first layer an input that needs a
    # gradient, halving this (the trainer test below).
    assert warmed == 8
    recompiles = compile_layer.recompiles()
    for b, s, n in ((3, 52, 5), (5, 20, 3), (1, 64, 9), (2, 33, 7)):
        _loss_and_grads(drafter, _inputs(b, s, n, seed=b), compiled=True)
    assert compile_layer.graphs_compiled() - before == warmed
    assert compile_layer.recompiles() == recompiles


def test_compile_layer_gives_equal_sizes_separate_symbols(fresh_dynamo):
    """Two inputs of equal length at the first call must not share a symbol: unequal ones later reuse the graph."""
    fn = compile_layer.compiled("test_separate_symbols", lambda x, y: x.sum(-1) + y.sum(-1).mean(), dynamic=True,
                                backend="eager")
    fn(torch.ones(3, 8), torch.ones(3, 8))
    graphs = compile_layer.graphs_compiled()
    fn(torch.ones(3, 9), torch.ones(3, 11))
    fn(torch.ones(4, 10), torch.ones(5, 10))
    assert compile_layer.graphs_compiled() == graphs


# ------------------------------------------------------------------------------------------ trainer


@pytest.mark.parametrize("budget,kinds", [(400, {"one row", "several"}), (256, {"one row"})])
def test_trainer_warm_up_covers_the_planned_batch_kinds_and_steps_never_compile(
        tmp_path, tiny_target_dir, counting_jsonl, monkeypatch, fresh_dynamo, budget, kinds):
    """The trainer's wiring on CPU with the device check lifted and Dynamo's eager backend: the warm-up
    compiles the drafter's graphs for the batch kinds the data plan has (one row, several), then steps add
    none. A budget of 256 tokens fits one of these conversations per batch: one kind, half the graphs."""
    import dflash_train.config.validate as config_mod
    from dflash_train.data.batch import Batch
    from dflash_train.train.start import rank_checks
    from dflash_train.train import trainer
    from dflash_train.train.loop.step import TrainStep

    monkeypatch.setattr(config_mod, "validate_compile_device", lambda *a: None)
    monkeypatch.setattr(rank_checks, "validate_compile_device", lambda *a: None)
    monkeypatch.setattr(drafter_mod, "COMPILE_BACKEND", "eager")
    rows_seen, graphs_at = [], []
    original_step = TrainStep.__call__

    def training_step(self, micro, step):  # the steps only, not the warm-up's calls of the objective
        batch = micro if isinstance(micro, Batch) else micro[0].batch
        rows_seen.append(batch.input_ids.shape[0])
        graphs_at.append(compile_layer.graphs_compiled())
        return original_step(self, micro, step)

    monkeypatch.setattr(TrainStep, "__call__", training_step)
    cfg = config_from_dict({
        "target": {"path": str(tiny_target_dir)},
        "drafter": {"num_draft_layers": 2, "block_size": 4, "attention_backend": "sdpa", "compile": True},
        "data": {"train_files": [str(counting_jsonl)], "max_length": 256, "token_budget": budget, "max_batch_size": 3},
        "objective": {"max_anchors": 16, "gamma": 4.0},
        "optim": {"lr": 3e-3, "epochs": 10, "warmup_ratio": 0.05},
        "run": {"device": "cpu", "log_every": 1, "save_every": 100, "progress_bar": False, "eval_every": 0},
    })
    trainer.train(cfg, tmp_path / "R", max_steps=12)
    status = json.loads((tmp_path / "R" / "status.json").read_text())
    assert status["phase"] == "done", status
    # (inputs, output + MLP) x the kinds (one row, several): one set for all layers (see DFlashObjective)
    assert status["drafter_compiled_graphs"] == 2 * len(kinds)
    assert len(rows_seen) == 12 and {"one row" if r == 1 else "several" for r in rows_seen} == kinds
    assert graphs_at[-1] == graphs_at[0]  # no step compiled anything
    records = [json.loads(line) for line in (tmp_path / "R" / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["recompiles"] == records[0]["recompiles"]


def test_compiled_calls_trace_once_float_constants_specialised(fresh_dynamo):
    """A layer's float attributes (RMSNorm eps) under dynamic shapes made Dynamo trace every function twice
    once AOTAutograd ran (a third of a cold compile on the GPU); the compile layer specialises them, so each
    traces once."""
    import logging

    class Messages(logging.Handler):
        def __init__(self):
            super().__init__(level=logging.INFO)
            self.seen: list[str] = []

        def emit(self, record):
            self.seen.append(record.getMessage())

    drafter = _drafter(layers=1)
    drafter.compile_layers(backend="aot_eager")
    handler = Messages()
    torch._logging.set_logs(dynamo=logging.INFO, recompiles=True)
    logging.getLogger("torch._dynamo").addHandler(handler)
    try:
        _loss_and_grads(drafter, _inputs(2, 24, 3), compiled=True)
    finally:
        logging.getLogger("torch._dynamo").removeHandler(handler)
        torch._logging.set_logs(recompiles=True)
    assert handler.seen  # Dynamo's INFO records reached the handler
    assert not [m for m in handler.seen if "Restarting analysis" in m]


def test_a_run_that_keeps_recompiling_stops_before_the_limit_with_a_checkpoint_and_resumes(
        tmp_path, tiny_target_dir, counting_jsonl, monkeypatch, fresh_dynamo):
    """Recompiles after the warm-up forced (the drafter's graphs compiled with static shapes: every new batch
    shape is a variant): each is logged with its failed guard and counted in metrics.jsonl; the run stops at a step
    boundary, before any function reaches the recompile limit, with a clear error in status.json and a checkpoint
    of that step; --resume (dynamic shapes again, a fresh Dynamo as in a new process) finishes the run."""
    import dflash_train.config.validate as config_mod
    from dflash_train.train.start import rank_checks
    from dflash_train.train import trainer

    monkeypatch.setattr(config_mod, "validate_compile_device", lambda *a: None)
    monkeypatch.setattr(rank_checks, "validate_compile_device", lambda *a: None)
    monkeypatch.setattr(drafter_mod, "COMPILE_BACKEND", "eager")
    # the warm-up leaves 7 variants of the busiest function; each step's new shape adds about one
    monkeypatch.setattr(compile_layer, "RECOMPILE_LIMIT", 12)
    monkeypatch.setattr(compile_layer, "_compiled", {})  # this test's static variants stay out of other tests
    monkeypatch.setattr(compile_layer, "_codes", {})
    real_compiled = compile_layer.compiled

    def static_drafter(name, fn, **kwargs):
        return real_compiled(name, fn, **{**kwargs, "dynamic": False} if name.startswith("drafter_") else kwargs)

    monkeypatch.setattr(compile_layer, "compiled", static_drafter)
    variants_seen = []
    real_check = compile_layer.recompile_headroom_error

    def check(ahead):
        variants_seen.append(max(compile_layer.compiled_variants().values()))
        return real_check(ahead)

    monkeypatch.setattr(compile_layer, "recompile_headroom_error", check)
    cfg = config_from_dict({
        "target": {"path": str(tiny_target_dir)},
        "drafter": {"num_draft_layers": 2, "block_size": 4, "attention_backend": "sdpa", "compile": True},
        "data": {"train_files": [str(counting_jsonl)], "max_length": 256, "token_budget": 400, "max_batch_size": 3},
        "objective": {"max_anchors": 16, "gamma": 4.0},
        "optim": {"lr": 3e-3, "epochs": 10, "warmup_ratio": 0.05},
        "run": {"device": "cpu", "log_every": 1, "save_every": 100, "progress_bar": False, "eval_every": 0},
    })
    run = tmp_path / "R"
    with pytest.raises(compile_layer.RecompileLimitNear, match=r"recompile limit \(12\)"):
        trainer.train(cfg, run, max_steps=24)
    status = json.loads((run / "status.json").read_text())
    assert status["phase"] == "failed" and "recompile limit (12)" in status["error"]["message"], status
    assert "--resume continues" in status["error"]["message"]
    stopped_at = status["step"]
    assert 0 < stopped_at < 24 and Path(status["checkpoint"]).name == f"step-{stopped_at:08d}"
    assert Path(status["checkpoint"]).is_dir() and f"with checkpoint {status['checkpoint']}" in status["error"]["message"]
    assert max(variants_seen) < 12  # never at the limit, where a compiled call fails mid-step
    lines = [line for line in (run / "train.log").read_text().splitlines()
             if "torch.compile recompiled after the warm-up (#" in line]
    assert lines and all("failed guard: " in line and "size mismatch" in line for line in lines), lines[:3]
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["step"] == stopped_at and records[-1]["recompiles_after_warmup"] == len(lines)
    assert status["recompiles_after_warmup"] == len(lines) and status["last_recompile"]

    monkeypatch.setattr(compile_layer, "compiled", real_compiled)
    monkeypatch.setattr(compile_layer, "_compiled", {})
    monkeypatch.setattr(compile_layer, "_codes", {})
    torch._dynamo.reset()  # a new process: no compiled variants
    trainer.train(cfg, run, max_steps=24, resume=True)
    status = json.loads((run / "status.json").read_text())
    assert status["phase"] == "done" and status["step"] == 24, status
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 25))
    assert records[-1]["recompiles_after_warmup"] == 0


@pytest.mark.slow
def test_validation_runs_the_warm_ups_graphs_and_compiles_nothing_mid_run(
        tmp_path, tiny_target_dir, counting_jsonl, monkeypatch, fresh_dynamo, caplog):
    """Validation has batches of its own sizes and runs without gradients in eval mode, which Dynamo compiles
    apart from training. Here every training batch holds one long conversation and every validation batch
    several short ones (another batch kind): the warm-up runs validation's extreme batches as validation runs
    them, so validating at steps 2, 4 and 6 compiles nothing after the seal."""
    import dflash_train.config.validate as config_mod
    from conftest import counting_conversations
    from dflash_train.train.start import rank_checks
    from dflash_train.train import trainer
    from dflash_train.train.start import warmup

    monkeypatch.setattr(config_mod, "validate_compile_device", lambda *a: None)
    monkeypatch.setattr(rank_checks, "validate_compile_device", lambda *a: None)
    monkeypatch.setattr(drafter_mod, "COMPILE_BACKEND", "eager")
    short = []
    for row in counting_conversations(12, seed=3):
        numbers = row["messages"][1]["content"].split()
        short.append({"messages": [row["messages"][0], {"role": "assistant", "content": " ".join(numbers[:8])}]})
    val = tmp_path / "val.jsonl"
    val.write_text("".join(json.dumps(r) + "\n" for r in short))
    after_warm_up, kinds_seen = [], []
    original = warmup.warm_up

    def warm_up(*args, **kwargs):
        info = original(*args, **kwargs)
        after_warm_up.append(compile_layer.graphs_compiled())
        kinds_seen.append(kwargs["kinds"])
        return info

    monkeypatch.setattr(warmup, "warm_up", warm_up)
    cfg = config_from_dict({
        "target": {"path": str(tiny_target_dir)},
        "drafter": {"num_draft_layers": 2, "block_size": 4, "attention_backend": "sdpa", "compile": True},
        "data": {"train_files": [str(counting_jsonl)], "val_files": [str(val)], "max_length": 256,
                 "token_budget": 256, "max_batch_size": 3},
        "objective": {"max_anchors": 16, "gamma": 4.0},
        "optim": {"lr": 3e-3, "epochs": 10, "warmup_ratio": 0.05},
        "run": {"device": "cpu", "log_every": 1, "save_every": 100, "progress_bar": False, "eval_every": 2,
                "eval_batches": 3, "eval_prompts": 1, "eval_max_new_tokens": 8},
    })
    run = tmp_path / "R"
    with caplog.at_level(logging.INFO, logger="dflash_train"):
        trainer.train(cfg, run, max_steps=6)
    status = json.loads((run / "status.json").read_text())
    assert status["phase"] == "done", status
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r.get("kind") == "validation"] == [2, 4, 6]
    assert compile_layer.graphs_compiled() == after_warm_up[0]  # no step and no validation compiled anything
    assert compile_layer.recompiles_after_warmup() == 0 and status["recompiles_after_warmup"] == 0
    assert "recompiled after the warm-up" not in caplog.text
    assert kinds_seen == [(True, False)]  # training: one conversation a batch
    val_rows = [int(m.group(1)) for m in re.finditer(r"warm-up validation batch \d+: (\d+) rows", caplog.text)]
    assert val_rows and min(val_rows) > 1 and status["warmup_validation_batches"] == len(val_rows)
    # validation's graphs (no grad, several rows) are its own: compiled by the warm-up, not mid-run
    assert status["validation_compiled_graphs"] > 0


@pytest.mark.long
def test_a_warm_start_takes_the_fp8_drafter_graphs_from_aotautograds_cache(tmp_path):
    """Two processes, one compile cache, an FP8 drafter's layers through inductor (~2 min on 2 cores): the first
    caches every graph with AOTAutograd (none bypassed: not for an autocast context, not for the FP8 matmul's
    autograd.Function), the second compiles nothing anew and takes them all from the caches, with bit-identical
    outputs and gradients."""
    import os
    import subprocess
    import sys

    worker = Path(__file__).parents[2] / "helpers" / "_aot_cache_worker.py"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[3] / "src")}
    stats, saved = [], []
    for run in ("cold", "warm"):
        out = tmp_path / f"{run}.pt"
        done = subprocess.run([sys.executable, str(worker), str(tmp_path / "cache"), str(out)], capture_output=True,
                              text=True, env=env, timeout=900)
        assert done.returncode == 0, done.stderr[-3000:]
        stats.append(json.loads(done.stdout.strip().splitlines()[-1]))
        saved.append(torch.load(out))
    cold, warm = stats
    assert cold["aot_cache_bypass"] == 0 and cold["aot_cache_miss"] >= 4, cold
    assert warm["aot_cache_bypass"] == warm["aot_cache_miss"] == warm["fxgraph_cache_miss"] == 0, warm
    assert warm["aot_cache_hit"] == cold["aot_cache_miss"], (cold, warm)
    assert saved[0].keys() == saved[1].keys()
    assert all(torch.equal(saved[0][k], saved[1][k]) for k in saved[0]), "a cached graph computed other numbers"
