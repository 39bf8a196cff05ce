"""Recompiles of the compiled drafter step over a real data plan, on one GPU.

    PYTHONPATH=src python benchmarks/recompiles.py --data data.jsonl.gz --tokenizer TOKDIR --steps 120 \
        [--options '{"triton.autotune_pointwise": false}'] [--no-extremes] [--guards OUT/guards.txt]

The drafter of `--shape` (2 layers, compiled, flex attention, bf16) trains on the micro-batches of the real
plan (the data tokenised with the tokenizer, `--max-length`, `--token-budget`, `--max-batch-size`), epoch 0
from its first batch, with stand-in target captures (random, of the right shape): the target's compile is
not what this measures. The trainer's own warm-up runs first (the first batch, the other batch kind, and
unless `--no-extremes` the plan's extreme batches). `--options` replaces the compile layer's inductor
options (the default is its own `INDUCTOR_OPTIONS`). Prints one JSON line: warm-up time, graphs the extreme
batches compiled, recompiles after the warm-up with their failed guards, step times; `--guards` writes
every size relation in the guards of the compiled functions after the warm-up.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import statistics
import time
from pathlib import Path

import torch

SIZE_RELATION = re.compile(r"size\(\)\[\d+\].*(<|>|==|!=|%)|(<|>|==|!=).*size\(\)\[\d+\]")


def guard_relations() -> dict[str, list[str]]:
    """Per compiled function and variant: the guard lines that relate sizes (not the plain type and dtype checks)."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    from dflash_train.accel import compile as compile_layer

    out = {}
    for name, code in compile_layer._codes.items():
        for i, entry in enumerate(_debug_get_cache_entry_list(code)):
            try:
                text = str(entry.guard_manager)
            except Exception as e:  # the printer is a debugging aid of Dynamo's, not an API
                text = f"(guards not printable: {type(e).__name__}: {e})"
            out[f"{name} #{i}"] = sorted({line.strip() for line in text.splitlines() if SIZE_RELATION.search(line)})
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--tokenizer", required=True)
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--max-length", type=int, default=1024)
    p.add_argument("--token-budget", type=int, default=16384)
    p.add_argument("--max-batch-size", type=int, default=16)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--intermediate", type=int, default=12288)
    p.add_argument("--options", default=None, help="JSON: the compile layer's inductor options instead of its own")
    p.add_argument("--no-extremes", action="store_true")
    p.add_argument("--cache-dir", default="/tmp/recompiles-cache")
    p.add_argument("--guards", default=None)
    p.add_argument("--label", default="")
    p.add_argument("--cpu-smoke", action="store_true", help="a check of this script on a CPU (sdpa, Dynamo's eager "
                   "backend, float32): no numbers")
    args = p.parse_args()

    from transformers import Qwen3Config

    from dflash_train.config.load import config_from_dict
    from dflash_train.data.batch import collate
    from dflash_train.data.dataset import batches_from, plan_batches
    from dflash_train.data.source import open_training_data
    from dflash_train.accel import compile as compile_layer
    from dflash_train.architectures.family.backend import resolve_backend
    from dflash_train.architectures.dflash.model import DFlashDrafter
    from dflash_train.architectures.family.config import make_drafter_config
    from dflash_train.target.capture import TargetHead, load_tokenizer
    from dflash_train.train.plan import size_classes
    from dflash_train.train.loop.step import MicroBatch, TrainStep
    from dflash_train.train.start.warmup import batch_kinds, warm_up

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.options is not None:
        compile_layer.INDUCTOR_OPTIONS = json.loads(args.options)
    cache = compile_layer.configure_cache(args.cache_dir, fresh=True)
    compile_layer.watch_recompiles()
    device = torch.device("cpu" if args.cpu_smoke else "cuda")
    dtype = torch.float32 if args.cpu_smoke else torch.bfloat16
    if args.cpu_smoke:
        import dflash_train.architectures.family.model as drafter_mod

        drafter_mod.COMPILE_BACKEND = "eager"
    else:
        compile_layer.start_compile_workers()

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()
    tok = load_tokenizer(args.tokenizer)
    cfg = config_from_dict({
        "drafter": {"num_draft_layers": args.layers, "block_size": 16, "mask_token_id": 16},
        "data": {"train_files": [args.data], "max_length": args.max_length, "token_budget": args.token_budget,
                 "max_batch_size": args.max_batch_size},
        "objective": {"max_anchors": 512, "gamma": 7.0},
        "run": {"device": device.type},
    })
    data = open_training_data(cfg, tok, cfg.drafter.block_size)
    tcfg = Qwen3Config(hidden_size=args.hidden, intermediate_size=args.intermediate, num_hidden_layers=8,
                       num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, head_dim=128,
                       vocab_size=len(tok))
    layer_ids = [1, 5] if args.layers == 2 else list(range(1, 1 + args.layers))
    torch.manual_seed(0)
    drafter = DFlashDrafter(make_drafter_config(tcfg, num_draft_layers=args.layers, block_size=16,
                                                target_layer_ids=layer_ids, mask_token_id=16)).to(device)
    drafter.compile_layers()
    embed = torch.nn.Embedding(tcfg.vocab_size, args.hidden, device=device, dtype=dtype).requires_grad_(False)
    head = torch.nn.Linear(args.hidden, tcfg.vocab_size, bias=False, device=device, dtype=dtype).requires_grad_(False)
    backend = resolve_backend("sdpa" if args.cpu_smoke else "flex", device, 16)
    step_fn = TrainStep(drafter, TargetHead(embed, head), backend, cfg, args.steps, dtype, device)
    width = len(layer_ids) * args.hidden

    def capture(batch):
        return torch.randn(*batch.input_ids.shape, width, device=device, dtype=dtype)

    batching = (data.lengths, cfg.data.token_budget, cfg.data.max_batch_size, cfg.run.seed)
    epoch0 = plan_batches(*batching, 0)
    first = collate([data.example(i) for i in epoch0[0]], tok.pad_token_id).to(device)
    edges = size_classes.extreme_classes(data.lengths, *batching[1:], range(0, 2), 16, 512, 0,
                                         backend.blocks_multiple_of)
    extremes = [] if args.no_extremes else [
        collate([data.example(i) for i in rows], tok.pad_token_id).to(device)
        for rows, _ in size_classes.warm_up_batches(edges, skip=tuple(epoch0[0]))]
    t0 = time.time()
    info = warm_up(step_fn, first, cache, hidden=capture(first), kinds=batch_kinds(epoch0),
                   extremes=tuple(extremes))
    sync()
    warm_s = time.time() - t0
    if args.guards:
        Path(args.guards).write_text(json.dumps(guard_relations(), indent=1))

    times, recompiled_at = [], []
    for n, (_, _, _, rows) in enumerate(batches_from(*batching, 0, 0)):
        if n >= args.steps:
            break
        batch = collate([data.example(i) for i in rows], tok.pad_token_id).to(device)
        before = compile_layer.recompiles_after_warmup()
        sync()
        t = time.perf_counter()
        step_fn([MicroBatch(batch, capture(batch))], n)
        sync()
        times.append(time.perf_counter() - t)
        if compile_layer.recompiles_after_warmup() > before:
            recompiled_at.append({"step": n, "rows": len(rows), "seq": batch.input_ids.shape[1],
                                  "seconds": round(times[-1], 2), "last": compile_layer.last_recompile()})
    clean = [t for n, t in enumerate(times) if n not in {r["step"] for r in recompiled_at}]
    print(json.dumps({
        "label": args.label, "torch": torch.__version__, "inductor_options": compile_layer.INDUCTOR_OPTIONS,
        "extremes": len(extremes), "warmup_s": round(warm_s, 2),
        "drafter_compiled_graphs": info["drafter_compiled_graphs"],
        "extreme_batches_compiled_graphs": info.get("extreme_batches_compiled_graphs"),
        "recompiles_after_warmup": compile_layer.recompiles_after_warmup(), "recompiled_at": recompiled_at,
        "steps": len(times), "step_s_median": round(statistics.median(clean), 4),
        "step_s_sum_clean": round(sum(clean), 2), "step_s_sum": round(sum(times), 2),
        "variants": compile_layer.compiled_variants(), "plan": size_classes.describe(edges),
    }), flush=True)


if __name__ == "__main__":
    main()
