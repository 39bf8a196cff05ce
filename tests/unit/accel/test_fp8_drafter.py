"""`drafter.fp8` on the CPU: the FP8 matmul's forward and both gradients against float64 products of operands
quantised along the contracted dimension (and against the exact float64 linear), the operand layouts the CUDA
kernel needs, autocast dtypes, which drafter linears switch (same parameters, same names), the compiled layers
(AOTAutograd's joint graph; inductor on the CPU: slow), the refusals, and a CPU training run that learns and
exports. Inductor on a GPU and the numerics against bf16 there: tests/gpu/."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import yaml
from torch import nn

from dflash_train.architectures.family.config import make_drafter_config
from dflash_train.architectures.family.mask import dense_mask
from dflash_train.architectures.attention import sdpa_attention
from dflash_train.architectures.dflash.model import DFlashDrafter
from dflash_train.cli import main
from dflash_train.config.load import config_from_dict
from dflash_train.errors import ConfigError
from dflash_train.accel import compile as compile_layer
from dflash_train.accel.fp8 import dequantize, quantize
from dflash_train.accel.fp8_training import Fp8Matmul, Fp8TrainingLinear, fp8_drafter_linears, use_fp8_training
from dflash_train.architectures.io import load_drafter
from dflash_train.train.plan.fp8_plan import check_fp8_device
from _harness import write_config

# Each operand element is rounded by at most 2^-4 of itself; a product of two rounded operands is off by at most
# sqrt(2) * 2^-4 relative (independent errors).
MATMUL_BOUND = 2**0.5 * 2.0**-4
H, BS = 64, 4


def _q64(x: torch.Tensor, dim: int) -> torch.Tensor:
    """`x` quantised with power-of-two scales along `dim` (the contracted one), back in float64."""
    q, scale = quantize(x, dim=dim, power_of_2=True)
    return dequantize(q, scale, torch.float64)


def _operands(m: int = 37, k: int = 96, n: int = 48, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, k, generator=g) * torch.logspace(-1, 1, m)[:, None]).requires_grad_()
    w = (torch.randn(n, k, generator=g) * 0.05).requires_grad_()
    grad_out = torch.randn(m, n, generator=g) * torch.logspace(1, -1, n)
    return x, w, grad_out


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def test_forward_and_both_gradients_equal_float64_products_of_the_quantised_operands():
    x, w, g = _operands()  # 37 tokens: the grad-weight matmul pads them to 48
    y = Fp8Matmul.apply(x, w, torch.float32)
    y.backward(g)
    x_, w_ = x.detach(), w.detach()
    torch.testing.assert_close(y.detach().double(), _q64(x_, 1) @ _q64(w_, 1).t(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x.grad.double(), _q64(g, 1) @ _q64(w_, 0), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(w.grad.double(), _q64(g, 0).t() @ _q64(x_, 0), rtol=1e-5, atol=1e-6)
    assert x.grad.dtype == w.grad.dtype == torch.float32


def _q64_tensorwise(x: torch.Tensor) -> torch.Tensor:
    """`x` quantised with one power-of-two scale (amax / 448 rounded up), back in float64: an independent reading
    of what `drafter.fp8_grad_weight=tensorwise` promises."""
    amax = float(x.detach().abs().max())
    scale = 2.0 ** torch.ceil(torch.log2(torch.tensor(amax / 448.0, dtype=torch.float64)))
    q = (x.detach().double() / scale).clamp(-448, 448).float().to(torch.float8_e4m3fn)
    return q.double() * scale


def test_the_grad_weight_modes_equal_float64_products_of_their_operands():
    """tensorwise: dW from dy and x each cast with the one scale of its whole tensor; bf16: dW = dy^T @ x in
    bf16. The forward and the input gradient are the row-wise ones in every mode."""
    x, w, g = _operands()
    Fp8Matmul.apply(x, w, torch.float32).backward(g)
    rowwise = (x.grad.clone(), w.grad.clone())
    for mode, expected_w, tol in [("tensorwise", _q64_tensorwise(g).t() @ _q64_tensorwise(x), 1e-5),
                                  ("bf16", g.bfloat16().double().t() @ x.detach().bfloat16().double(), 8e-3)]:
        x.grad = w.grad = None
        y = Fp8Matmul.apply(x, w, torch.float32, mode)
        y.backward(g)
        torch.testing.assert_close(x.grad, rowwise[0], rtol=0, atol=0)
        torch.testing.assert_close(w.grad.double(), expected_w, rtol=tol, atol=tol * float(expected_w.abs().max()))
        assert w.grad.dtype == torch.float32
        assert not torch.equal(w.grad, rowwise[1]), mode


def test_the_bf16_grad_weight_of_a_bf16_linear_is_the_bf16_matmul():
    x, w, g = _operands(m=32)
    xb = x.detach().bfloat16().requires_grad_()
    Fp8Matmul.apply(xb, w, torch.bfloat16, "bf16").backward(g.bfloat16())
    torch.testing.assert_close(w.grad, (g.bfloat16().t() @ xb.detach()).float(), rtol=0, atol=0)


def test_forward_and_gradients_are_within_fp8_rounding_of_the_exact_linear(capsys):
    x, w, g = _operands(m=64, seed=1)
    Fp8Matmul.apply(x, w, torch.float32).backward(g)
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    y64 = x64 @ w64.t()
    y64.backward(g.double())
    errors = {"forward": _rel(Fp8Matmul.apply(x.detach(), w.detach(), torch.float32), y64.detach()),
              "grad_input": _rel(x.grad, x64.grad), "grad_weight": _rel(w.grad, w64.grad)}
    with capsys.disabled():
        print(f"\nFP8 matmul relative errors against float64: { {k: round(v, 4) for k, v in errors.items()} }")
    assert all(0.005 < e < MATMUL_BOUND for e in errors.values()), errors  # really FP8, and within its rounding


def test_every_scaled_mm_gets_the_layouts_the_cuda_kernel_takes(monkeypatch):
    """cuBLASLt's FP8 GEMM: the first operand row-major, the second column-major, scales [M, 1] and [1, N],
    contracted and output dimensions multiples of 16. The CPU kernel takes anything, so this checks each call."""
    real = torch._scaled_mm
    calls = []

    def checked(a, b, scale_a, scale_b, out_dtype):
        assert a.is_contiguous() and b.t().is_contiguous(), (a.stride(), b.stride())
        assert scale_a.shape == (a.shape[0], 1) and scale_b.shape == (1, b.shape[1])
        assert scale_a.is_contiguous() and scale_b.is_contiguous() and scale_a.dtype == scale_b.dtype == torch.float32
        assert a.shape[1] % 16 == 0 and b.shape[1] % 16 == 0
        calls.append(a.shape)
        return real(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype)

    monkeypatch.setattr(torch, "_scaled_mm", checked)
    x, w, g = _operands(m=21)
    Fp8Matmul.apply(x, w, torch.float32).backward(g)
    assert calls == [(21, 96), (21, 48), (48, 32)]  # forward, grad input, grad weight (tokens padded 21 -> 32)


def test_tensorwise_grad_weight_gives_the_cuda_kernel_its_layouts_and_scalar_scales(monkeypatch):
    real = torch._scaled_mm
    calls = []

    def checked(a, b, scale_a, scale_b, out_dtype):
        assert a.is_contiguous() and b.t().is_contiguous(), (a.stride(), b.stride())
        assert a.shape[1] % 16 == 0 and b.shape[1] % 16 == 0
        calls.append((a.shape, scale_a.shape, scale_b.shape, out_dtype))
        return real(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype)

    monkeypatch.setattr(torch, "_scaled_mm", checked)
    x, w, g = _operands(m=21)
    Fp8Matmul.apply(x, w, torch.bfloat16, "tensorwise").backward(g.bfloat16())
    assert calls[2] == ((48, 32), (), (), torch.float32)  # tokens padded 21 -> 32, one scale each, a float32 dW


def test_a_grad_weight_mode_without_drafter_fp8_is_refused_by_name():
    with pytest.raises(ConfigError, match=r"'drafter.fp8_grad_weight'.*set drafter.fp8=true"):
        config_from_dict({"drafter": {"fp8_grad_weight": "bf16"}})
    with pytest.raises(ConfigError, match=r"drafter.fp8_grad_weight"):
        config_from_dict({"drafter": {"fp8": True, "fp8_grad_weight": "fp8"}})
    assert config_from_dict({"drafter": {"fp8": True, "fp8_grad_weight": "tensorwise"}}).drafter.fp8_grad_weight \
        == "tensorwise"


def test_autocast_gives_the_compute_dtype_and_master_weight_gradients():
    torch.manual_seed(0)
    layer = Fp8TrainingLinear(64, 32, bias=True)
    x = torch.randn(2, 5, 64, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    assert y.dtype == torch.bfloat16 and y.shape == (2, 5, 32)
    y.float().sum().backward()
    assert layer.weight.grad.dtype == layer.bias.grad.dtype == x.grad.dtype == torch.float32
    torch.testing.assert_close(layer.bias.grad, torch.full((32,), 10.0))
    assert layer(x).dtype == torch.float32  # no autocast: the input's dtype


def _drafter(seed: int = 0, **kw) -> DFlashDrafter:
    from transformers import Qwen3Config

    tcfg = Qwen3Config(hidden_size=H, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, vocab_size=1000)
    torch.manual_seed(seed)
    return DFlashDrafter(make_drafter_config(tcfg, num_draft_layers=2, block_size=BS, target_layer_ids=[1, 5],
                                             mask_token_id=3, **kw))


def test_the_projections_and_fc_switch_keeping_their_parameters_and_names():
    drafter = _drafter(draft_vocab_size=32)
    params = dict(drafter.named_parameters())
    keys = list(drafter.state_dict())
    names = use_fp8_training(drafter)
    per_layer = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
                 "mlp.up_proj", "mlp.down_proj"]
    assert names == [f"layers.{i}.{n}" for i in range(2) for n in per_layer] + ["fc"]
    assert type(drafter.lm_head) is nn.Linear  # the reduced vocabulary's head stays in the compute dtype
    assert all(p is params[n] for n, p in drafter.named_parameters())  # the optimizer's parameters, unchanged
    assert list(drafter.state_dict()) == keys
    assert {n for n, _ in fp8_drafter_linears(drafter)} == set(names)
    assert all(isinstance(m, Fp8TrainingLinear) for _, m in fp8_drafter_linears(drafter))


def test_dflash2_keeps_its_own_small_projections_out():
    from transformers import Qwen3Config

    from dflash_train.architectures.dflash2.config import make_dflash2_config
    from dflash_train.architectures.dflash2.model import DFlash2Drafter

    tcfg = Qwen3Config(hidden_size=H, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, vocab_size=1000)
    drafter = DFlash2Drafter(make_dflash2_config(tcfg, num_draft_layers=1, block_size=BS, target_layer_ids=[1, 5],
                                                 mask_token_id=3))
    names = use_fp8_training(drafter)
    assert len(names) == 8 and not any("kernel_projection" in n or "selector" in n for n in names)


def _inputs(b: int = 2, s: int = 24, n_blocks: int = 3, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(b, s, 2 * H, generator=g)
    embeds = torch.randn(b, n_blocks * BS, H, generator=g)
    anchors = torch.stack([torch.randperm(s - BS, generator=g)[:n_blocks].sort().values for _ in range(b)])
    keep = torch.ones(b, n_blocks, dtype=torch.bool)
    block_pos = (anchors.unsqueeze(-1) + torch.arange(BS)).view(b, -1)
    position_ids = torch.cat([torch.arange(s).expand(b, s), block_pos], dim=1)
    return hidden, embeds, position_ids, dense_mask(anchors, keep, s, BS)


def _loss_and_grads(drafter, inputs, compiled: bool):
    drafter.zero_grad(set_to_none=True)
    out = drafter(*inputs[:3], sdpa_attention, inputs[3], compiled_layers=compiled)
    out.float().pow(2).mean().backward()
    return out.detach(), {n: p.grad.clone() for n, p in drafter.named_parameters()}


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.long)])
def test_compiled_fp8_layers_equal_the_eager_ones(fresh_dynamo, backend):
    """aot_eager: Dynamo's graph of the FP8 autograd.Function through AOTAutograd's joint forward/backward (what
    inductor gets), fullgraph; inductor on the CPU compiles the fused quantisation (slow)."""
    eager = _drafter()
    use_fp8_training(eager)
    compiled = copy.deepcopy(eager)
    compiled.compile_layers(backend=backend)
    inputs = _inputs()
    out, grads = _loss_and_grads(eager, inputs, compiled=False)
    got, got_grads = _loss_and_grads(compiled, inputs, compiled=True)
    tol = dict(rtol=1e-5, atol=1e-5) if backend == "aot_eager" else dict(rtol=2e-2, atol=2e-3)
    torch.testing.assert_close(got, out, **tol)
    for name, g in grads.items():
        torch.testing.assert_close(got_grads[name], g, **tol, msg=name)
    graphs = compile_layer.graphs_compiled()
    _loss_and_grads(compiled, _inputs(b=3, s=31, n_blocks=5, seed=1), compiled=True)  # new sizes: no recompile
    assert compile_layer.graphs_compiled() == graphs


def test_shapes_and_dtypes_fp8_refuses(tmp_path, tiny_target_dir, counting_jsonl, capsys, monkeypatch):
    from dflash_train.train.start import target_load

    monkeypatch.setattr(target_load, "load_target_model", lambda *a, **k: pytest.fail("weights loaded"))
    cfg = {"target": {"path": str(tiny_target_dir)},
           "drafter": {"num_draft_layers": 1, "block_size": 4, "attention_backend": "sdpa", "fp8": True,
                       "intermediate_size": 120},
           "data": {"train_files": [str(counting_jsonl)], "max_length": 256, "token_budget": 1024},
           "run": {"device": "cpu", "progress_bar": False}}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    assert main(["train", str(tmp_path / "c.yaml"), "--run-dir", str(tmp_path / "R")]) == 2
    err = capsys.readouterr().err
    assert "'drafter.fp8'" in err and "layers.0.mlp.gate_proj [120, 64]" in err and not (tmp_path / "R").exists()
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda _d=None: (9, 0))
    with pytest.raises(ConfigError, match=r"'drafter.fp8'.*run.dtype must be bfloat16 or auto.*float32"):
        check_fp8_device(config_from_dict({"drafter": {"fp8": True}}), torch.device("cuda", 0), torch.bfloat16,
                         torch.float32)


def test_a_cpu_run_with_an_fp8_drafter_learns_and_exports(tmp_path, tiny_target_dir, counting_jsonl):
    # torch._scaled_mm on the CPU is a slow reference kernel (~1 s a step here): 8 small steps, the loss falls by ~5
    write_config(tmp_path / "c.yaml", tiny_target_dir, counting_jsonl, drafter__fp8=True, optim__lr=5e-3,
                 run__log_every=4, run__save_every=100, run__eval_every=0, run__export_dtype="float32")
    run = tmp_path / "R"
    assert main(["train", str(tmp_path / "c.yaml"), "--run-dir", str(run), "--max-steps", "8"]) == 0
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if "loss" in line]
    assert records[-1]["loss"] < records[0]["loss"] - 0.5
    exported = load_drafter(run / "export")  # a plain drafter: FP8 is how it trained, not what it is
    assert type(exported.fc) is nn.Linear and exported.fc.weight.dtype == torch.float32
