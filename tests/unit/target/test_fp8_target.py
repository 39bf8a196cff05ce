"""`target.quantize=fp8` on the CPU (torch's CPU `_scaled_mm` takes e4m3 operands with row-wise scales): the
quantisation against its float64 error bound, the quantised linear against a float64 product of the same
quantised operands, the captured hidden states of a tiny random Qwen3 against a float32 capture, the loading
(which layers, what memory), the refusals before any weights load, and a CPU training run that learns and
exports. Inductor's fusion and the CUDA kernel are checked on a GPU (tests/gpu/)."""

from __future__ import annotations

import copy
import json
import logging

import pytest
import torch
import yaml
from torch import nn

from dflash_train.cli import main
from dflash_train.config.load import config_from_dict
from dflash_train.errors import ConfigError
from dflash_train.accel import compile as compile_layer
from dflash_train.target import capture as target_mod
from dflash_train.accel.fp8 import FP8, FP8_MAX, dequantize, quantize, scales
from dflash_train.architectures.io import load_drafter
from dflash_train.target.capture import TargetCapture, load_target_model, target_fp8_linears
from dflash_train.target.quantize import Fp8Linear, quantize_decoder_layers, quantized_bytes_saved
from dflash_train.train.plan import preflight
from dflash_train.train.plan.fp8_plan import check_fp8_device, check_fp8_shapes, fp8_target_layers

# e4m3 keeps 3 mantissa bits: round to nearest is off by at most half a unit in the last place, 2^-4 of the
# value for normal numbers; below 2^-6 (subnormals, spacing 2^-9) at most 2^-10 absolute.
REL_ROUNDING = 2.0**-4
SUBNORMAL_HALF_STEP = 2.0**-10


def _rows(seed: int = 0) -> torch.Tensor:
    """Rows of very different magnitudes (row-wise scales must serve each), an outlier and an all-zero row."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(12, 96, generator=g, dtype=torch.float64) * torch.logspace(-6, 4, 12, dtype=torch.float64)[:, None]
    x[3, 7] = 1e5
    x[5] = 0
    return x


# ------------------------------------------------------------------------------------------ numerics


def test_quantisation_round_trip_is_within_e4m3_rounding_of_each_row():
    x = _rows()
    q, scale = quantize(x)
    assert q.dtype == FP8 and scale.dtype == torch.float32 and scale.shape == (12, 1)
    amax = x.abs().amax(1, keepdim=True)
    nonzero = amax.squeeze(1) > 0
    torch.testing.assert_close(scale.double()[nonzero], (amax / FP8_MAX)[nonzero], rtol=1e-6, atol=0)
    assert float(q.double().abs().amax(1)[nonzero].min()) == FP8_MAX  # each row's largest value uses the top
    assert torch.isfinite(q.double()).all() and not q.double()[5].any()  # the zero row stays zero, no NaN
    err = (dequantize(q, scale, torch.float64) - x).abs()
    v = (x / scale.double()).abs()  # what was rounded
    bound = scale.double() * torch.maximum(v * REL_ROUNDING, torch.full_like(v, SUBNORMAL_HALF_STEP))
    assert bool((err <= bound * (1 + 1e-6)).all())
    assert float((err / bound.clamp(min=1e-300)).max()) > 0.9  # the bound is the real one, not a loose one


def test_power_of_two_scales_only_shift_exponents():
    x = _rows(1)
    q, scale = quantize(x, power_of_2=True)
    exponent = torch.log2(scale.double())
    assert torch.equal(exponent, exponent.round())
    amax, s = x.abs().amax(1), scale.double().squeeze(1)
    nonzero = amax > 0  # the smallest power of two at or above amax / 448: nothing overflows, half the range kept
    assert bool((s[nonzero] >= amax[nonzero] / FP8_MAX).all()) and bool((s[nonzero] < 2 * amax[nonzero] / FP8_MAX).all())
    assert torch.isfinite(q.double()).all()
    torch.testing.assert_close(scales(x, power_of_2=True), scale)


def test_quantised_linear_equals_a_float64_product_of_its_quantised_operands():
    torch.manual_seed(0)
    linear = nn.Linear(96, 48, bias=True).requires_grad_(False)
    fp8 = Fp8Linear.from_linear(linear)
    x = torch.randn(3, 7, 96) * torch.logspace(-2, 2, 7)[:, None]
    out = fp8(x).detach()
    assert out.shape == (3, 7, 48) and out.dtype == torch.float32
    x_q, x_scale = quantize(x.reshape(-1, 96))
    ref = dequantize(x_q, x_scale, torch.float64) @ dequantize(fp8.weight_fp8, fp8.weight_scale.t(), torch.float64).t()
    ref = ref + linear.bias.double()
    torch.testing.assert_close(out.reshape(-1, 48).double(), ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
    # and against the unquantised layer: within the per-matmul bound sqrt(2) * 2^-4 (both operands rounded)
    exact = linear(x).double()
    assert float((out.double() - exact).norm() / exact.norm()) < 2**0.5 * REL_ROUNDING
    assert fp8.weight_fp8.dtype == FP8 and fp8.weight_scale.shape == (1, 48) and not hasattr(fp8, "weight")


def _qwen3(layers: int = 6, seed: int = 0):
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(seed)
    cfg = Qwen3Config(hidden_size=128, intermediate_size=384, num_hidden_layers=layers, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=32, vocab_size=1000)
    return AutoModelForCausalLM.from_config(cfg).eval().requires_grad_(False)


def _layer_errors(got: torch.Tensor, ref: torch.Tensor, hidden: int) -> list[float]:
    """Relative (Frobenius) error of each captured layer's slice of `[B, S, K*H]`."""
    return [float((got[..., i:i + hidden] - ref[..., i:i + hidden]).norm() / ref[..., i:i + hidden].norm())
            for i in range(0, ref.shape[-1], hidden)]


# Measured on this model (2 x 64 tokens, layers 1, 3, 5): fp8 0.069, 0.075, 0.075; bfloat16 0.007, 0.008, 0.009.
# Bound: each quantised matmul is off by at most sqrt(2) * 2^-4 = 0.088 relative (both operands rounded by up to
# 2^-4, independent errors); the attention and MLP branches chain two of them (q/k/v then o; gate/up then down),
# sqrt(2) * 0.088 = 0.125. The floor: a capture within 3x of bfloat16's error did not run in FP8.
CAPTURE_BOUND = 0.125


def test_fp8_capture_error_of_a_tiny_qwen3_is_bounded_and_reported(capsys):
    model = _qwen3()
    ids = torch.randint(0, 1000, (2, 64), generator=torch.Generator().manual_seed(0))
    layers = [1, 3, 5]
    ref = TargetCapture.from_model(model, layers)(ids)
    bf16 = TargetCapture.from_model(copy.deepcopy(model).to(torch.bfloat16), layers)(ids).float()
    quantised = copy.deepcopy(model)
    done = quantize_decoder_layers(quantised.model.layers, max(layers) + 1, torch.device("cpu"))
    assert len(done.quantized) == 7 * 6 and done.left_high_precision == []
    got = TargetCapture.from_model(quantised, layers)(ids)
    fp8_err, bf16_err = _layer_errors(got, ref, 128), _layer_errors(bf16, ref, 128)
    with capsys.disabled():
        print(f"\nfp8 capture relative error per layer {[round(e, 4) for e in fp8_err]}; "
              f"bfloat16 {[round(e, 4) for e in bf16_err]}")
    assert all(e < CAPTURE_BOUND for e in fp8_err)
    assert all(f > 3 * b for f, b in zip(fp8_err, bf16_err))


# ------------------------------------------------------------------------------------------ loading


def test_loading_quantises_the_layers_the_capture_runs_and_nothing_else(tiny_target_dir):
    plain = load_target_model(tiny_target_dir, torch.float32, torch.device("cpu"))
    model = load_target_model(tiny_target_dir, torch.float32, torch.device("cpu"), fp8_layers=5)
    layers = model.model.layers
    for i, layer in enumerate(layers):
        kinds = {type(m) for m in layer.modules() if isinstance(m, (nn.Linear, Fp8Linear))}
        assert kinds == ({Fp8Linear} if i < 5 else {nn.Linear}), (i, kinds)
    assert isinstance(model.lm_head, nn.Linear) and model.lm_head.weight.dtype == torch.float32
    assert torch.equal(model.model.embed_tokens.weight, plain.model.embed_tokens.weight)
    assert torch.equal(layers[5].mlp.down_proj.weight, plain.model.layers[5].mlp.down_proj.weight)
    q = layers[2].self_attn.k_proj
    w, s = quantize(plain.model.layers[2].self_attn.k_proj.weight, dim=1)
    assert torch.equal(q.weight_fp8.view(torch.uint8), w.view(torch.uint8)) and torch.equal(q.weight_scale, s.t())
    ids = torch.randint(0, 1000, (1, 9))
    with torch.no_grad():  # the whole model (speculative decoding in validation) runs with its FP8 layers
        assert torch.isfinite(model(input_ids=ids).logits).all()


def test_the_layers_quantised_follow_the_capture():
    cfg = config_from_dict({"target": {"quantize": "fp8"}})
    assert fp8_target_layers(cfg, [1, 4], 6) == 5
    assert fp8_target_layers(config_from_dict({}), [1, 4], 6) == 0
    distill = config_from_dict({"target": {"quantize": "fp8"}, "objective": {"distill_weight": 0.5}})
    assert fp8_target_layers(distill, [1, 4], 6) == 6  # with_final runs every layer


def test_an_architecture_that_reads_the_targets_final_state_quantises_every_layer():
    """Its captures run every layer (`reads_target_final`): all of them FP8 alike, none left in bf16 to compile
    a second graph of the shared layer forward."""
    from dflash_train.architectures import reads_target_final

    plain = config_from_dict({"target": {"quantize": "fp8"}})
    final = config_from_dict({"target": {"quantize": "fp8"}, "drafter": {"architecture": "dspark"}})
    assert not reads_target_final(plain) and reads_target_final(final)
    assert fp8_target_layers(final, [1, 4], 6) == 6
    assert fp8_target_layers(config_from_dict({"drafter": {"architecture": "dspark"}}), [1, 4], 6) == 0


def test_preflight_counts_one_byte_a_quantised_weight_plus_its_scales(tiny_target_dir):
    cfg = config_from_dict({"target": {"path": str(tiny_target_dir), "quantize": "fp8"}})
    saved = check_fp8_shapes(cfg, tiny_target_dir, 5, torch.bfloat16, None, None)
    model = load_target_model(tiny_target_dir, torch.bfloat16, torch.device("cpu"), fp8_layers=5)
    resident = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()]
                   if t.dtype != torch.float32 or t.ndim == 2)  # weights and scales (not the rotary buffer)
    params = preflight.checkpoint_parameters(tiny_target_dir)
    assert preflight.needed_bytes(params, torch.bfloat16, 0, "target", target_bytes_saved=saved) - preflight.MARGIN == resident
    linears = target_fp8_linears(tiny_target_dir, False, 5)
    assert len(linears) == 35 and saved == quantized_bytes_saved(linears, 2) > 0


# ------------------------------------------------------------------------------------------ refusals


def test_the_key_is_typed_and_off_by_default():
    assert config_from_dict({}).target.quantize == "none"
    with pytest.raises(ConfigError, match=r"'target.quantize'.*'none' \| 'fp8'"):
        config_from_dict({"target": {"quantize": "int8"}})


def test_shapes_scaled_mm_refuses_fail_before_any_weights_load(tmp_path, tokenizer_dir, counting_jsonl, capsys,
                                                               monkeypatch):
    from conftest import make_tiny_target
    from dflash_train.train.start import target_load

    target = make_tiny_target(tmp_path / "odd", tokenizer_dir, layers=3, intermediate_size=120)
    monkeypatch.setattr(target_load, "load_target_model", lambda *a, **k: pytest.fail("weights loaded"))
    cfg = {"target": {"path": str(target), "quantize": "fp8"},
           "drafter": {"num_draft_layers": 1, "block_size": 4, "attention_backend": "sdpa",
                       "target_layer_ids": [0, 1], "intermediate_size": 128},
           "data": {"train_files": [str(counting_jsonl)], "max_length": 256, "token_budget": 1024},
           "run": {"device": "cpu", "progress_bar": False}}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    assert main(["train", str(tmp_path / "c.yaml"), "--run-dir", str(tmp_path / "R")]) == 2
    err = capsys.readouterr().err
    assert "'target.quantize'" in err and "layers.0.mlp.gate_proj [120, 64]" in err and "multiples of 16" in err
    assert "layers.1.mlp.down_proj [64, 120]" in err and "layers.2" not in err  # only the layers the capture runs
    assert not (tmp_path / "R").exists()


def test_a_gpu_without_fp8_or_a_non_bf16_dtype_is_refused(monkeypatch):
    cfg = config_from_dict({"target": {"quantize": "fp8"}})
    gpu = torch.device("cuda", 0)  # nothing is allocated: the check reads the capability only
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda _d=None: (8, 0))
    with pytest.raises(ConfigError, match=r"'target.quantize'.*compute capability 8.9.*8\.0"):
        check_fp8_device(cfg, gpu, torch.bfloat16, torch.bfloat16)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda _d=None: (9, 0))
    check_fp8_device(cfg, gpu, torch.bfloat16, torch.bfloat16)
    with pytest.raises(ConfigError, match=r"'target.quantize'.*target.dtype must be bfloat16 or auto.*float16"):
        check_fp8_device(cfg, gpu, torch.float16, torch.bfloat16)
    check_fp8_device(cfg, torch.device("cpu"), torch.float32, torch.float32)  # the CPU runs float32
    check_fp8_device(config_from_dict({}), gpu, torch.float16, torch.float32)  # off: nothing to check


# ------------------------------------------------------------------------------------------ compiled and trained


@pytest.fixture
def cpu_compile(monkeypatch, request):
    """`target.compile` allowed on the CPU with the parametrised backend; fresh Dynamo caches around."""
    monkeypatch.setattr(target_mod, "_COMPILE_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(target_mod, "_COMPILE_BACKEND", request.param)
    compile_layer.watch_recompiles()
    torch._dynamo.reset()
    yield request.param
    torch._dynamo.reset()


@pytest.mark.parametrize("cpu_compile", ["eager", pytest.param("inductor", marks=pytest.mark.long)], indirect=True)
def test_the_quantised_layers_compile_in_one_graph_and_equal_eager(cpu_compile):
    """Dynamo's "eager" backend: the FP8 linear traces without a graph break (fullgraph); inductor on the CPU
    compiles it with the activation quantisation fused (slow)."""
    model = _qwen3(layers=4)
    quantize_decoder_layers(model.model.layers, 4, torch.device("cpu"))
    eager = TargetCapture.from_model(model, [1, 3])
    comp = TargetCapture.from_model(model, [1, 3], compile=True)
    info = comp.warm_up(length=40)  # fullgraph: a graph break in the FP8 linear would raise
    assert info["target_compiled_graphs"] == 2 and info["target_recompiled_after_warmup"] == 0
    ids = torch.randint(0, 1000, (2, 23))
    got, ref = comp(ids), eager(ids)
    if cpu_compile == "eager":
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    else:  # fused norms round differently, so some activations land on the next e4m3 value: a share f of
        # elements off by one e4m3 step (2^-3 relative) is a relative error of ~0.125 * sqrt(f): 0.0115 (f ~ 0.85%)
        # on one CPU, 0.01 on another; the bound allows f up to ~2.5%, far below FP8's own 0.07
        assert max(_layer_errors(got, ref, 128)) < 0.02


@pytest.mark.parametrize("cpu_compile", ["eager"], indirect=True)
def test_a_partly_quantised_target_compiles_one_layer_graph_per_batch_kind(cpu_compile):
    """FP8 up to the last captured layer (the plan's), the later layers bf16: the warm-up runs the layers the
    captures run (with_final=False), so every layer it compiles is FP8 and the shared layer forward has one graph
    per batch kind, no failed guard. Run over every layer (with_final), the bf16 layers fail the guard on their
    linears' type and compile a second graph: what the plan avoids."""
    layer_ids = [0, 1]
    fp8_layers = fp8_target_layers(config_from_dict({"target": {"quantize": "fp8"}}), layer_ids, 4)
    model = _qwen3(layers=4)
    quantize_decoder_layers(model.model.layers, fp8_layers, torch.device("cpu"))
    assert [isinstance(layer.mlp.up_proj, Fp8Linear) for layer in model.model.layers] == [True, True, False, False]
    counts = {}
    for with_final in (False, True):
        torch._dynamo.reset()
        before = compile_layer.recompiles()
        capture = TargetCapture.from_model(model, layer_ids, compile=True)
        info = capture.warm_up(length=40, one_row=False, with_final=with_final)  # one batch kind: batch >= 2
        counts[with_final] = (info["target_compiled_graphs"], compile_layer.recompiles() - before,
                              info["target_recompiled_after_warmup"])
    assert counts[False] == (1, 0, 0), counts
    assert counts[True] == (2, 1, 0), counts  # once more for the bf16 layers, a recompile


def test_a_cpu_run_with_an_fp8_target_learns_and_exports(tmp_path, tiny_target_dir, counting_jsonl, caplog):
    caplog.set_level(logging.INFO, logger="dflash_train")  # train.log gets the info lines too
    cfg = {"target": {"path": str(tiny_target_dir), "quantize": "fp8"},
           "drafter": {"num_draft_layers": 1, "block_size": 4, "attention_backend": "sdpa"},
           "data": {"train_files": [str(counting_jsonl)], "max_length": 256, "token_budget": 1024,
                    "max_batch_size": 4},
           "objective": {"max_anchors": 16, "gamma": 4.0},
           "optim": {"lr": 5e-3, "epochs": 10, "warmup_ratio": 0.05},
           "run": {"device": "cpu", "log_every": 5, "save_every": 100, "eval_every": 0, "progress_bar": False}}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    run = tmp_path / "R"
    assert main(["train", str(tmp_path / "c.yaml"), "--run-dir", str(run), "--max-steps", "30"]) == 0
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if "loss" in line]
    assert records[-1]["loss"] < records[0]["loss"] - 0.5
    assert "target.quantize=fp8: 28 linears of decoder layers 0..3 in FP8" in (run / "train.log").read_text()
    assert load_drafter(run / "export").fc.weight.dtype == torch.bfloat16

    # eval on the target as it is served in FP8 (every layer): lossless against that target's own greedy
    # output, which is not the unquantised target's
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": i, "turns": [t]}) + "\n" for i, t in
                               enumerate(["Count from 3.", "Name a colour.", "Say something about rivers."])))
    reports = {}
    for quantize in ("fp8", "none"):
        out = tmp_path / f"eval-{quantize}.json"
        assert main(["eval", "--target", str(tiny_target_dir), "--drafter", str(run / "export"), "--data",
                     str(prompts), "--out", str(out), "--max-new-tokens", "12", "--target-quantize", quantize]) == 0
        reports[quantize] = json.loads(out.read_text())
    fp8, plain = reports["fp8"], reports["none"]
    assert fp8["config"]["target_quantize"] == "fp8" and plain["config"]["target_quantize"] == "none"
    assert fp8["datasets"][str(prompts)]["lossless_mismatches"] == []

    def target_tokens(report):
        return [o["modes"]["target"][0]["token_ids"] for o in report["outputs"]]
    assert target_tokens(fp8) != target_tokens(plain)


def test_eval_on_an_fp8_target_refuses_what_scaled_mm_cannot_run_before_loading(tmp_path, tokenizer_dir, monkeypatch):
    from conftest import make_tiny_target
    from dflash_train.infer.evaluate import load_eval_target

    odd = make_tiny_target(tmp_path / "odd", tokenizer_dir, layers=3, intermediate_size=120)
    with pytest.raises(ConfigError, match=r"--target-quantize fp8.*layers.0.mlp.gate_proj \[120, 64\].* and 3 more"):
        # every layer: 9 linears of 3 layers, not only those a training capture would run
        load_eval_target(odd, torch.float32, torch.device("cpu"), "fp8")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda _d=None: (9, 0))
    with pytest.raises(ConfigError, match=r"--target-quantize fp8.*--dtype must be bfloat16 or auto.*float32"):
        load_eval_target(odd, torch.float32, torch.device("cuda", 0), "fp8")


@pytest.mark.slow
@pytest.mark.long
def test_a_split_target_rank_quantises_as_the_colocated_run_does(tmp_path, tiny_target_dir, counting_jsonl):
    """Split 1+1 over gloo with target.quantize=fp8 logs exactly the losses of the colocated FP8 run (which differ
    from the unquantised run's): the target rank loaded the same quantised target."""
    from _harness import assert_same_losses, losses, run, write_config

    cfg = write_config(tmp_path / "c.yaml", tiny_target_dir, counting_jsonl, run__eval_every=0)
    out = {}
    for name, nproc, extra in (("fp8", 1, ["target.quantize=fp8"]), ("plain", 1, []),
                               ("split", 2, ["target.quantize=fp8", "parallel.placement=split"])):
        out[name] = tmp_path / name
        rc = run(["train", str(cfg), *extra, "--run-dir", str(out[name]), "--max-steps", "4", "--nproc", str(nproc)],
                 tmp_path / f"{name}.log")
        assert rc == 0, (tmp_path / f"{name}.log").read_text()[-3000:]
    assert_same_losses(losses(out["fp8"]), losses(out["split"]), 4)
    assert losses(out["plain"]) != pytest.approx(losses(out["fp8"]), rel=1e-4)
