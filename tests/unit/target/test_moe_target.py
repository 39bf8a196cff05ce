"""Mixture-of-experts targets (Qwen3-MoE, Qwen3.5-MoE): they load as targets and the capture equals the
HF model's own `output_hidden_states` in float64 (its per-expert loop: `grouped_mm`, the default
experts kernel, has no float64), eager and through `target.compile`'s wiring (Dynamo's
eager backend on CPU; inductor numerics are a GPU test)."""

import importlib.util
from pathlib import Path

import pytest
import torch

from dflash_train.accel import compile as compile_layer
from dflash_train.target.capture import TargetCapture, load_target_model, read_target_config
from _moe_targets import MOE, VOCAB, qwen3_5_moe, qwen3_moe, save  # noqa: F401


def _language_model(model):
    inner = model.model
    return getattr(inner, "language_model", inner)


def _reference(path, ids):
    """The HF model's own hidden states, float64, loaded by transformers itself, experts one by one."""
    from transformers import AutoModelForImageTextToText, AutoModelForCausalLM, AutoConfig

    cfg = AutoConfig.from_pretrained(path)
    cls = AutoModelForImageTextToText if hasattr(cfg, "vision_config") else AutoModelForCausalLM
    model = cls.from_pretrained(path, dtype=torch.float64, experts_implementation="eager").eval()
    with torch.no_grad():
        return _language_model(model)(input_ids=ids, output_hidden_states=True).hidden_states


BUILDS = pytest.mark.parametrize("build", [qwen3_moe, qwen3_5_moe], ids=["qwen3-moe", "qwen3.5-moe"])


@BUILDS
def test_moe_target_loads_and_captures_its_hidden_states(tmp_path, build):
    path = save(build, tmp_path)
    cfg = read_target_config(path)
    assert cfg.num_experts == 8 and cfg.num_hidden_layers == 4
    model = load_target_model(path, torch.float32, torch.device("cpu"))
    assert not any(p.requires_grad for p in model.parameters())
    ids = torch.randint(0, VOCAB, (3, 13), generator=torch.Generator().manual_seed(1))
    ref = _reference(path, ids)
    layer_ids = [0, 1, 2]  # the last layer's HF hidden state is after the final norm: not a layer output
    cap = TargetCapture.from_model(model, layer_ids)
    got = cap(ids)
    want = torch.cat([ref[i + 1] for i in layer_ids], -1)
    assert got.dtype == torch.float32 and got.shape == (3, 13, 3 * 64)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    # The fixture routes tokens to many experts (a zero router would send every token to the same two).
    router = next(m for n, m in model.named_modules() if n.endswith("layers.0.mlp.gate"))
    chosen = router(_language_model(model).embed_tokens(ids).reshape(-1, 64))[-1]
    assert chosen.unique().numel() > 4


def test_moe_target_compiled_capture_equals_eager(tmp_path, eager_backend):
    """`target.compile` on a Qwen3-MoE target: one graph per decoder-layer class traced through the
    expert routing (data-dependent expert choice), the capture equal to the eager one."""
    path = save(qwen3_moe, tmp_path)
    model = load_target_model(path, torch.float32, torch.device("cpu"))
    ids = torch.randint(0, VOCAB, (2, 17), generator=torch.Generator().manual_seed(2))
    eager = TargetCapture.from_model(model, [0, 2])(ids)
    compiled = TargetCapture.from_model(model, [0, 2], compile=True)
    compiled.warm_up(length=29)
    torch.testing.assert_close(compiled(ids), eager, rtol=1e-5, atol=1e-5)
    assert compile_layer.graphs_compiled() > 0


def _benchmark():
    spec = importlib.util.spec_from_file_location("throughput", Path(__file__).parents[3] / "benchmarks" / "throughput.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_benchmark_moe_shape_counts_active_parameters():
    """benchmarks/throughput.py's Qwen3-30B-A3B-class shape: the real model's size (30.5B resident, 3.3B active)
    built on the meta device, and its MFU numerator counts a token's router and 8 of 128 experts per layer."""
    from transformers import AutoModelForCausalLM

    bench = _benchmark()
    shape = bench.SHAPES["qwen3-30b-a3b-class"]
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(bench.target_config(shape))
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    total = sum(p.numel() for p in model.parameters())
    assert 30.4e9 < total < 30.6e9
    layer = model.model.layers[0]
    experts = sum(p.numel() for p in layer.mlp.experts.parameters())
    matmuls = sum(m.weight.numel() for m in layer.self_attn.modules() if isinstance(m, torch.nn.Linear))
    active = matmuls + layer.mlp.gate.weight.numel() + experts * 8 // 128
    assert bench.layer_matmul_params(shape) == active
    embeddings = 2 * shape["vocab_size"] * shape["hidden_size"]
    assert 3.2e9 < active * 48 + embeddings < 3.4e9  # "3.3B activated"
    dense = bench.SHAPES["qwen3-8b"]  # unchanged for dense shapes: attention + the 3 MLP matmuls
    assert bench.layer_matmul_params(dense) == 4096 * 128 * (32 * 2 + 8 * 2) + 3 * 4096 * 12288


def test_preflight_counts_every_expert_as_resident(tmp_path):
    """A MoE target keeps all its experts in memory, however few a token uses: the preflight's count is the
    checkpoint's every tensor (per-expert tensors on disk, fused in the model), the model's whole size."""
    from dflash_train.train.plan import preflight

    path = save(qwen3_moe, tmp_path)
    model = load_target_model(path, torch.float32, torch.device("cpu"))
    resident = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    assert experts > resident / 3  # the fixture's experts are a large part of it
    assert preflight.checkpoint_parameters(path) == resident
    assert preflight.needed_bytes(resident, torch.bfloat16, 0, "colocated") == preflight.MARGIN + 2 * resident
