"""Predict the throughput of a split placement (T target GPUs + D drafter GPUs) from one-GPU rates.

    PYTHONPATH=src python benchmarks/plan_split.py --target-rate 12000 --drafter-rate 7000 --gpus 8
    PYTHONPATH=src python benchmarks/plan_split.py --from-json bench.jsonl --shape qwen3-27b-class --gpus 8

Rates are target tokens per second per GPU, each side measured alone (`throughput.py --part`).
Target ranks and drafter ranks form a pipeline: with double-buffered transport the run goes at the
slower side, min(T * target_rate, D * drafter_rate) (an upper bound: it ignores transport and
bubbles, which the multi-GPU runs measure).

A target too large for one GPU (`target.sharding: fsdp`, issue 23), memory and rate per target GPU:

    PYTHONPATH=src python benchmarks/plan_split.py --sharded llama3-70b-class --gpus 8 --drafter-rate 2500

The model of a shard group of G GPUs (FSDP2 over the captured decoder layers, each rank its own micro-batch):
- memory per GPU = the captured layers' weights / G + two gathered layers (the one running and the prefetched
  next; none when G = 1) + the input embedding / G + the micro-batch's activations (no grad: the residual
  stream, one MLP/expert intermediate, the captured states double-buffered for sending) + a fixed overhead;
- time per micro-batch = max(compute, all-gather) + one exposed layer gather, where compute = the target's
  FLOPs (`throughput.target_flops`, active parameters for MoE) / (MFU x peak) and the all-gather receives
  (G - 1) / G of every captured layer's bytes at the given bus bandwidth; prefetching hides the smaller one.
MFU, peak and bandwidth are inputs (defaults: the 8B target's measured 78% of ~790 TFLOP/s; 360 GB/s, an
assumed NVLink all-gather bus bandwidth of an 8-GPU H200 host). Nothing here is measured on several GPUs.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass

GIB = 2**30
# Planning shapes (no GPU needed): dense layers, or MoE layers with `experts` of width `moe_intermediate`, `active`
# of them per token. The numbers are the public configs' (Qwen3-8B, Qwen3-32B, Llama-3-70B, Qwen3-30B-A3B).
PLAN_SHAPES = {
    "qwen3-8b": dict(hidden_size=4096, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                     head_dim=128, intermediate_size=12288, vocab_size=151936),
    "qwen3-32b": dict(hidden_size=5120, num_hidden_layers=64, num_attention_heads=64, num_key_value_heads=8,
                      head_dim=128, intermediate_size=25600, vocab_size=151936),
    "llama3-70b-class": dict(hidden_size=8192, num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                             head_dim=128, intermediate_size=28672, vocab_size=128256),
    "qwen3-30b-a3b": dict(hidden_size=2048, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                          head_dim=128, intermediate_size=6144, vocab_size=151936, experts=128, active=8,
                          moe_intermediate=768),
}


def predict(target_rate: float, drafter_rate: float, t: int, d: int) -> float:
    return min(t * target_rate, d * drafter_rate)


def best_split(target_rate: float, drafter_rate: float, gpus: int) -> tuple[int, int, float]:
    options = [(t, gpus - t, predict(target_rate, drafter_rate, t, gpus - t)) for t in range(1, gpus)]
    return max(options, key=lambda o: o[2])


def rates_from_json(path: str, shape: str) -> tuple[float, float]:
    rows = [json.loads(line) for line in open(path) if line.strip()]
    by_part = {r["part"]: r for r in rows if r.get("shape") == shape and r.get("part") in ("target", "drafter")}
    missing = {"target", "drafter"} - set(by_part)
    if missing:
        raise SystemExit(f"{path}: no {', '.join(sorted(missing))} measurement for shape {shape}")
    return by_part["target"]["tokens_per_s"], by_part["drafter"]["tokens_per_s"]


def layer_params(c: dict, active_only: bool = False) -> int:
    """Matmul parameters of one decoder layer (attention + MLP, or attention + router + experts: all of them
    resident, `active` of them per token)."""
    h, nh, nkv, hd = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    attention = h * nh * hd * 2 + h * nkv * hd * 2
    if "experts" not in c:
        return attention + 3 * h * c["intermediate_size"]
    experts = c["active"] if active_only else c["experts"]
    return attention + h * c["experts"] + experts * 3 * h * c["moe_intermediate"]


def captured_layers(c: dict, num_ids: int = 5) -> int:
    """Decoder layers a capture runs: up to the last of the default target layer ids."""
    layers = c["num_hidden_layers"]
    if num_ids == 1:
        return layers // 2 + 1
    return layers - 3 + 1  # the default rule ends at layer L - 3


def target_flops_per_microbatch(c: dict, tokens: int, seq: int, layers: int) -> float:
    """Forward FLOPs of `layers` decoder layers over `tokens` tokens in sequences of `seq` (causal attention):
    2 x active matmul parameters per token, plus the attention scores and values."""
    per_token = 2 * layer_params(c, active_only=True) * layers
    attention = 4 * c["num_attention_heads"] * c["head_dim"] * (seq * (seq + 1) / 2) * (tokens / seq) * layers
    return per_token * tokens + attention


@dataclass
class ShardPlan:
    group: int
    memory_gib: dict  # part -> GiB per GPU
    compute_s: float
    gather_s: float
    microbatch_s: float
    tokens_per_s: float  # per target GPU

    @property
    def total_gib(self) -> float:
        return sum(self.memory_gib.values())


def plan_shard_group(c: dict, group: int, *, tokens: int = 8192, seq: int = 2048, num_ids: int = 5,
                     weight_bytes: float = 2.0, mfu: float = 0.78, peak_tflops: float = 790.0,
                     allgather_gbps: float = 360.0, overhead_gib: float = 3.0) -> ShardPlan:
    """One target GPU of a shard group of `group` (see the module's docstring for the model)."""
    layers = captured_layers(c, num_ids)
    h = c["hidden_size"]
    layer_bytes = layer_params(c) * weight_bytes
    width = c["active"] * c["moe_intermediate"] if "experts" in c else c["intermediate_size"]
    memory = {
        "weights (shard)": layers * layer_bytes / group / GIB,
        "gathered layers": (2 * layer_bytes if group > 1 else 0.0) / GIB,
        "embedding (shard)": c["vocab_size"] * h * weight_bytes / group / GIB,
        # bf16 activations without grad: residual + normed + attention output, gate/up of one MLP (or of the
        # active experts), the captured states for `num_ids` layers, double-buffered for sending
        "activations": tokens * (3 * h + 2 * width + 2 * num_ids * h) * 2 / GIB,
        "overhead": overhead_gib,
    }
    compute = target_flops_per_microbatch(c, tokens, seq, layers) / (mfu * peak_tflops * 1e12)
    received = (group - 1) / group * layer_bytes
    gather = layers * received / (allgather_gbps * 1e9)
    microbatch = max(compute, gather) + received / (allgather_gbps * 1e9)
    return ShardPlan(group, memory, compute, gather, microbatch, tokens / microbatch)


def smallest_fitting_group(c: dict, gpus: int, capacity_gib: float, **kw) -> ShardPlan | None:
    """The smallest power-of-two shard group (at most `gpus`) whose per-GPU memory fits `capacity_gib`."""
    for g in (2**i for i in range(int(math.log2(gpus)) + 1)):
        plan = plan_shard_group(c, g, **kw)
        if plan.total_gib <= capacity_gib:
            return plan
    return None


def print_sharded(shape: str, gpus: int, drafter_rate: float | None, capacity_gib: float, **kw) -> None:
    c = PLAN_SHAPES[shape]
    print(f"{shape}: {captured_layers(c)} captured layers of {c['num_hidden_layers']}, "
          f"{layer_params(c) * captured_layers(c) / 1e9:.1f}B captured weights "
          f"({layer_params(c, active_only=True) * captured_layers(c) / 1e9:.1f}B active per token)")
    print("| shard group | weights | gathered | embedding | activations | total GiB/GPU | fits | compute s | "
          "all-gather s | micro-batch s | tokens/s per target GPU |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    g = 1
    while g <= gpus:
        p = plan_shard_group(c, g, **kw)
        m = p.memory_gib
        print(f"| {g} | {m['weights (shard)']:.1f} | {m['gathered layers']:.1f} | {m['embedding (shard)']:.1f} | "
              f"{m['activations']:.1f} | {p.total_gib:.1f} | {'yes' if p.total_gib <= capacity_gib else 'no'} | "
              f"{p.compute_s:.3f} | {p.gather_s:.3f} | {p.microbatch_s:.3f} | {p.tokens_per_s:,.0f} |")
        g *= 2
    if "experts" in c:
        print("\nMoE: compute assumes the given MFU on the active parameters; transformers' expert loop (one small "
              "matmul per expert) runs far below a dense layer's MFU: measure `throughput.py` on a MoE shape first")
    best = smallest_fitting_group(c, gpus, capacity_gib, **kw)
    if best is None:
        print(f"\nno shard group of up to {gpus} GPUs fits {capacity_gib:.0f} GiB per GPU")
        return
    if drafter_rate:
        print(f"\nsplit placements of {gpus} GPUs, target shard groups of {best.group} "
              f"({best.tokens_per_s:,.0f} tokens/s per target GPU), drafter {drafter_rate:,.0f} tokens/s per GPU:")
        print("| target GPUs + drafter GPUs | predicted tokens/s | bound by |")
        print("|---|---|---|")
        for t in range(best.group, gpus, best.group):
            d = gpus - t
            p = predict(best.tokens_per_s, drafter_rate, t, d)
            print(f"| {t} + {d} | {p:,.0f} | {'target' if t * best.tokens_per_s < d * drafter_rate else 'drafter'} |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target-rate", type=float)
    ap.add_argument("--drafter-rate", type=float)
    ap.add_argument("--from-json")
    ap.add_argument("--shape", default="qwen3-8b")
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--sharded", choices=sorted(PLAN_SHAPES), help="plan a sharded target of this shape")
    ap.add_argument("--capacity-gib", type=float, default=125.0,
                    help="memory a plan may use per GPU (H200: ~139 GiB usable; the default keeps ~10%% for the "
                         "allocator's fragmentation and peaks the model does not count)")
    ap.add_argument("--weight-bytes", type=float, default=2.0, help="bytes per target weight (bf16 2, fp8 ~1)")
    ap.add_argument("--mfu", type=float, default=0.78, help="target MFU (the 8B target measured 78-81%%)")
    ap.add_argument("--peak-tflops", type=float, default=790.0)
    ap.add_argument("--allgather-gbps", type=float, default=360.0, help="assumed all-gather bus bandwidth")
    ap.add_argument("--tokens", type=int, default=8192, help="tokens per target micro-batch")
    ap.add_argument("--seq", type=int, default=2048)
    args = ap.parse_args()
    if args.sharded:
        print_sharded(args.sharded, args.gpus, args.drafter_rate, args.capacity_gib, tokens=args.tokens,
                      seq=args.seq, weight_bytes=args.weight_bytes, mfu=args.mfu, peak_tflops=args.peak_tflops,
                      allgather_gbps=args.allgather_gbps)
        return
    if args.from_json:
        tr, dr = rates_from_json(args.from_json, args.shape)
    else:
        tr, dr = args.target_rate, args.drafter_rate
    print(f"one GPU: target {tr:,.0f} tok/s, drafter {dr:,.0f} tok/s (target tokens)")
    print("| split (T + D) | predicted tokens/s | bound by |")
    print("|---|---|---|")
    for t in range(1, args.gpus):
        d = args.gpus - t
        p = predict(tr, dr, t, d)
        print(f"| {t} + {d} | {p:,.0f} | {'target' if t * tr < d * dr else 'drafter'} |")
    t, d, p = best_split(tr, dr, args.gpus)
    print(f"\nbest split of {args.gpus} GPUs: {t} + {d} -> {p:,.0f} tokens/s")


if __name__ == "__main__":
    main()
