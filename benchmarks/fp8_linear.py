"""One drafter linear, forward + backward, compiled as the drafter's layers are (dynamic shapes, bf16 autocast,
float32 master weight): bf16 against `drafter.fp8` with each `drafter.fp8_grad_weight`, at the 8B drafter's
shapes (4 x 2048 tokens, 512 anchors x block 16: 32,768 block rows; k/v also read the 8,192 context rows).

Reports per distinct linear shape and per drafter layer (q, k, v, o, gate, up, down; not fc, once per step) the
time of forward + backward, its TFLOP/s (6 M K N / t), and the weight gradient's relative error against float32
on the same inputs (token rows of unequal magnitude, as hidden states have). With --profile, the largest kernels
of each mode's down projection.

    PYTHONPATH=src python benchmarks/fp8_linear.py [--json F] [--profile]
"""

from __future__ import annotations

import argparse
import json

import torch
from torch import nn

# (name, tokens M, in K, out N, per layer, input needs a gradient): one row per distinct shape
SHAPES_8B = [
    ("q_proj/o_proj", 32768, 4096, 4096, 2, True),
    ("k_proj/v_proj", 40960, 4096, 1024, 2, True),
    ("gate_proj/up_proj", 32768, 4096, 12288, 2, True),
    ("down_proj", 32768, 12288, 4096, 1, True),
]
MODES = ["bf16", "fp8-rowwise", "fp8-tensorwise", "fp8-bf16gw"]


def make_linear(mode: str, k: int, n: int, device: torch.device) -> nn.Module:
    from dflash_train.accel.fp8_training import Fp8TrainingLinear

    torch.manual_seed(0)
    lin = nn.Linear(k, n, bias=False, device=device)
    if mode == "bf16":
        return lin
    fp8 = Fp8TrainingLinear(k, n, bias=False, device="meta")
    fp8.weight = lin.weight
    fp8.grad_weight = {"fp8-rowwise": "rowwise", "fp8-tensorwise": "tensorwise", "fp8-bf16gw": "bf16"}[mode]
    return fp8


def inputs(m: int, k: int, n: int, needs_grad: bool, device: torch.device):
    g = torch.Generator(device=device).manual_seed(1)
    row_scale = torch.logspace(-1, 1, m, device=device)[torch.randperm(m, device=device, generator=g)]
    x = (torch.randn(m, k, device=device, generator=g) * row_scale[:, None]).bfloat16().requires_grad_(needs_grad)
    grad_out = torch.randn(m, n, device=device, generator=g).bfloat16() * 1e-2
    return x, grad_out


def timed_ms(fn, repeat: int) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeat):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeat


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--json", default=None)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    device = torch.device("cuda")
    torch._dynamo.config.cache_size_limit = 64
    per_layer: dict[str, float] = {}
    for mode in args.modes.split(","):
        per_layer[mode] = 0.0
        for name, m, k, n, count, needs_grad in SHAPES_8B:
            torch._dynamo.reset()
            lin = make_linear(mode, k, n, device)
            fwd = torch.compile(lambda x: lin(x), dynamic=True, fullgraph=True)
            x, grad_out = inputs(m, k, n, needs_grad, device)

            def step():
                lin.weight.grad = None
                if x.grad is not None:
                    x.grad = None
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    y = fwd(x)
                y.backward(grad_out)

            ms = timed_ms(step, args.repeat)
            step()
            ref = grad_out.float().t() @ x.detach().float()
            gw_err = float((lin.weight.grad.float() - ref).norm() / ref.norm())
            flops = (6 if needs_grad else 4) * m * k * n
            row = {"mode": mode, "linear": name, "m": m, "k": k, "n": n, "ms": round(ms, 3),
                   "tflops": round(flops / ms / 1e9, 1), "grad_weight_rel_err": round(gw_err, 5)}
            print(json.dumps(row), flush=True)
            if args.json:
                with open(args.json, "a") as f:
                    f.write(json.dumps(row) + "\n")
            per_layer[mode] += ms * count
            if args.profile and name == "down_proj":
                from torch.profiler import ProfilerActivity, profile

                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    step()
                    torch.cuda.synchronize()
                print(f"-- {mode} {name}: kernels")
                print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=12))
    base = per_layer.get("bf16")
    for mode, ms in per_layer.items():
        ratio = f", {base / ms:.3f}x bf16" if base else ""
        print(json.dumps({"summary": mode, "layer_linears_ms": round(ms, 2), "note": f"q,k,v,o,gate,up,down{ratio}"}))


if __name__ == "__main__":
    main()
