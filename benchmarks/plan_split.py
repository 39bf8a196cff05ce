"""Predict the throughput of a split placement (T target GPUs + D drafter GPUs) from one-GPU rates.

    PYTHONPATH=src python benchmarks/plan_split.py --target-rate 12000 --drafter-rate 7000 --gpus 8
    PYTHONPATH=src python benchmarks/plan_split.py --from-json bench.jsonl --shape qwen3-27b-class --gpus 8

Rates are target tokens per second per GPU, each side measured alone (`throughput.py --part`).
Target ranks and drafter ranks form a pipeline: with double-buffered transport the run goes at the
slower side, min(T * target_rate, D * drafter_rate) (an upper bound: it ignores transport and
bubbles, which the multi-GPU runs measure).

A sharded target (`target.sharding: fsdp`, a target too large for one GPU), `--sharded`:

    PYTHONPATH=src python benchmarks/plan_split.py --sharded --shape llama3-70b-class --gpus 8 --drafter-rate 3000

The model, per rank and micro-batch of `--batch` x `--seq` tokens: each of the L layers a capture runs (up to the
last captured one) costs max(compute, gather), the next layer's all-gather overlapping this layer's compute
(the prefetch), plus the first layer's gather, which nothing hides:
  compute = the layer's FLOPs (throughput.py's count) / (target MFU x matmul peak), both measured on one GPU
            for a layer of that shape (`throughput.py --part target` on a shape that fits: MFU is a property of
            the layer's shape, 0.68 eager / 0.82 compiled for the 27B class on an H200);
  gather  = the layer's bytes x (g - 1) / g / the all-gather bus bandwidth (NCCL's busbw; an assumption to
            replace with nccl-tests' number on the machine).
Colocated over G GPUs (one shard group): G micro-batches per (capture + drafter step), the drafter's time from
its one-GPU rate. Split T + D (the target ranks one shard group): min(T x capture rate, D x drafter rate).
Memory per GPU: the preflight's count (train/plan/preflight.py: the shard, the embedding and lm_head whole, three
gathered layers, the drafter's 16 bytes a parameter, 2 GiB margin), activations not counted.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # throughput.py beside it: shapes and FLOP counts


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


@dataclass
class ShardedTarget:
    """One rank's capture of a sharded target, by the model in the module docstring."""

    shape: dict
    group: int  # ranks sharing the target
    last_layer: int  # the last captured layer (layers 0..last run)
    batch: int
    seq: int
    mfu: float
    peak_tflops: float
    busbw_gbs: float
    dtype_bytes: int = 2

    @property
    def tokens(self) -> int:
        return self.batch * self.seq

    @property
    def layers_run(self) -> int:
        return self.last_layer + 1

    def compute_s(self) -> float:
        """One layer's compute."""
        from throughput import target_flops

        flops = target_flops(self.shape, [self.seq] * self.batch, self.last_layer) / self.layers_run
        return flops / (self.mfu * self.peak_tflops * 1e12)

    def gather_s(self) -> float:
        """One layer's all-gather: each rank receives the (g - 1) / g of the layer it does not hold."""
        from throughput import layer_resident_params

        layer_bytes = layer_resident_params(self.shape) * self.dtype_bytes
        return layer_bytes * (self.group - 1) / self.group / (self.busbw_gbs * 1e9)

    def capture_s(self) -> float:
        return self.layers_run * max(self.compute_s(), self.gather_s()) + self.gather_s()

    def target_gib(self) -> float:
        """Target memory per rank, the preflight's way."""
        from throughput import layer_resident_params

        from dflash_train.train.plan.preflight import TargetShare

        c = self.shape
        layer = layer_resident_params(c)
        heads = 1 if c.get("tie_word_embeddings", True) else 2
        total = c["num_hidden_layers"] * layer + heads * c["vocab_size"] * c["hidden_size"]
        share = TargetShare(self.group, c["num_hidden_layers"] * layer, layer)
        return share.parameters(total) * self.dtype_bytes / 2**30


def drafter_params(shape: dict, layers: int) -> int:
    """The default drafter (layers of the target's shape, fc from K captured layers) on the meta device."""
    import torch
    from throughput import target_config

    from dflash_train.architectures.drafter import default_target_layer_ids
    from dflash_train.architectures.family.config import make_drafter_config
    from dflash_train.architectures.dflash.model import DFlashDrafter

    ids = default_target_layer_ids(shape["num_hidden_layers"], layers)
    with torch.device("meta"):
        d = DFlashDrafter(make_drafter_config(target_config(shape), num_draft_layers=layers, block_size=16,
                                              target_layer_ids=ids, mask_token_id=5))
    return sum(p.numel() for p in d.parameters())


GPU_GIB = 139.0  # an H200's usable memory


def sharded_plans(t: ShardedTarget, drafter_rate: float, gpus: int, drafter_gib: float, head_gib: float) -> list[dict]:
    """Colocated over all GPUs, and every split T + D with the T target ranks one shard group (`allowed`: the
    trainer's lockstep rule at optim.grad_accum=1, D a multiple of T)."""
    margin = 2.0
    capture = t.capture_s()
    rows = [{"plan": f"colocated, fsdp over {gpus}", "tokens_per_s": gpus * t.tokens / (capture + t.tokens / drafter_rate),
             "gib_per_gpu": t.target_gib() + drafter_gib + margin,
             "bound": "gather" if t.gather_s() > t.compute_s() else "compute", "allowed": True}]
    for n in range(1, gpus):
        shard = ShardedTarget(**{**t.__dict__, "group": n})
        target_side, drafter_side = n * t.tokens / shard.capture_s(), (gpus - n) * drafter_rate
        rows.append({"plan": f"split {n} + {gpus - n}, fsdp over {n}", "tokens_per_s": min(target_side, drafter_side),
                     "gib_per_gpu": max(shard.target_gib(), drafter_gib + head_gib) + margin,
                     "bound": "target" if target_side < drafter_side else "drafter",
                     "allowed": n == 1 or (gpus - n) % n == 0})
    for row in rows:
        row["fits"] = row["gib_per_gpu"] <= GPU_GIB
    return rows


def main_sharded(args) -> None:
    from throughput import SHAPES

    from dflash_train.architectures.drafter import default_target_layer_ids

    shape = SHAPES[args.shape]
    last = max(default_target_layer_ids(shape["num_hidden_layers"], args.layers))
    t = ShardedTarget(shape, args.gpus, last, args.batch, args.seq, args.target_mfu, args.peak_tflops, args.busbw)
    drafter_gib = drafter_params(shape, args.layers) * 16 / 2**30
    head_gib = (1 if shape.get("tie_word_embeddings", True) else 2) * shape["vocab_size"] * shape["hidden_size"] * 2 / 2**30
    print(f"{args.shape}: per layer compute {t.compute_s() * 1e3:.2f} ms, all-gather over {args.gpus} "
          f"{t.gather_s() * 1e3:.2f} ms; capture of {t.tokens} tokens {t.capture_s():.2f} s; drafter "
          f"{drafter_gib:.0f} GiB (weights + AdamW), one-GPU drafter rate {args.drafter_rate:,.0f} tok/s")
    print(f"| plan | predicted tokens/s | GiB per GPU (weights) | fits {GPU_GIB:.0f} GiB | bound by |")
    print("|---|---|---|---|---|")
    for row in sharded_plans(t, args.drafter_rate, args.gpus, drafter_gib, head_gib):
        note = "" if row["allowed"] else " (needs optim.grad_accum: D x accum a multiple of T)"
        print(f"| {row['plan']}{note} | {row['tokens_per_s']:,.0f} | {row['gib_per_gpu']:.0f} | "
              f"{'yes' if row['fits'] else 'no'} | {row['bound']} |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target-rate", type=float)
    ap.add_argument("--drafter-rate", type=float)
    ap.add_argument("--sharded", action="store_true", help="a sharded target's plans (module docstring)")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=5, help="drafter layers (which target layers are captured)")
    ap.add_argument("--target-mfu", type=float, default=0.68, help="one-GPU capture MFU of the layer shape")
    ap.add_argument("--peak-tflops", type=float, default=790.0, help="measured bf16 matmul peak (throughput.py)")
    ap.add_argument("--busbw", type=float, default=350.0, help="all-gather bus bandwidth, GB/s (assumed)")
    ap.add_argument("--from-json")
    ap.add_argument("--shape", default="qwen3-8b")
    ap.add_argument("--gpus", type=int, default=8)
    args = ap.parse_args()
    if args.sharded:
        return main_sharded(args)
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
