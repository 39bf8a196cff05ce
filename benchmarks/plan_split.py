"""Predict the throughput of a split placement (T target GPUs + D drafter GPUs) from one-GPU rates.

    PYTHONPATH=src python benchmarks/plan_split.py --target-rate 12000 --drafter-rate 7000 --gpus 8
    PYTHONPATH=src python benchmarks/plan_split.py --from-json bench.jsonl --shape qwen3-27b-class --gpus 8

Rates are target tokens per second per GPU, each side measured alone (`throughput.py --part`).
Target ranks and drafter ranks form a pipeline: with double-buffered transport the run goes at the
slower side, min(T * target_rate, D * drafter_rate) (an upper bound: it ignores transport and
bubbles, which the multi-GPU runs measure).
"""

from __future__ import annotations

import argparse
import json


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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target-rate", type=float)
    ap.add_argument("--drafter-rate", type=float)
    ap.add_argument("--from-json")
    ap.add_argument("--shape", default="qwen3-8b")
    ap.add_argument("--gpus", type=int, default=8)
    args = ap.parse_args()
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
