"""What a checkpoint costs the training loop: the synchronous write (`checkpoint.save_checkpoint`, the loop blocked
for the whole write) against the background writer (`checkpoint.CheckpointWriter`: the loop pays for the snapshot
to host memory; the files are written while steps go on), on a DFlash drafter with fused AdamW state.

    PYTHONPATH=src python benchmarks/checkpoint_stall.py --device cpu --shape small --out /tmp/ckpt-bench
    PYTHONPATH=src python benchmarks/checkpoint_stall.py --device cuda --shape qwen3-8b --out /local/disk/ckpt-bench

A "step" is an AdamW step over random gradients (the optimizer's own cost; no model forward). Prints one JSON
line: the checkpoint's size, the synchronous save's seconds, and for the background save the loop's stall (the
save call) of two saves after the host buffers were staged (`CheckpointWriter.stage`: seconds of page-locking on
CUDA, in a thread) and how long that staging took and slowed the steps, the steps' median time without a write and
while one is in flight, and the background write's seconds.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import time
from pathlib import Path

import torch

SHAPES = {  # the target's shape; the drafter is 5 layers of it (the default drafter)
    "small": dict(vocab_size=32000, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                  num_attention_heads=8, num_key_value_heads=4, head_dim=64),
    "qwen3-8b": dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="small")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=8, help="steps timed with and without a write in flight")
    args = ap.parse_args()

    from transformers import LlamaConfig

    from dflash_train.architectures.family.config import make_drafter_config
    from dflash_train.architectures.dflash.model import DFlashDrafter
    from dflash_train.train.checkpoint import CheckpointWriter, save_checkpoint

    device = torch.device(args.device)
    target = LlamaConfig(**SHAPES[args.shape])
    n = target.num_hidden_layers
    drafter = DFlashDrafter(make_drafter_config(target, num_draft_layers=5, block_size=16,
                                                target_layer_ids=[1, n // 4, n // 2, 3 * n // 4, n - 2],
                                                mask_token_id=5)).to(device)
    opt = torch.optim.AdamW(drafter.parameters(), lr=1e-4, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    for p in drafter.parameters():
        p.grad = torch.randn_like(p) * 1e-3

    def step() -> float:
        t0 = time.perf_counter()
        opt.step()
        sched.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    step()
    shutil.rmtree(args.out, ignore_errors=True)
    record = {"status": "running"}
    quiet = [step() for _ in range(args.steps)]
    if device.type == "cuda":
        torch.cuda.synchronize()
    # The background writer first, as the trainer runs it: its host buffers staged by a thread after the first step
    # (`stage`), before any other save could leave freed pinned blocks in torch's host cache for it to reuse.
    writer = CheckpointWriter(args.out / "async", keep_last=2)
    t0 = time.perf_counter()
    writer.stage(drafter, opt, sched)
    stage_call_s = time.perf_counter() - t0
    staged_steps = []
    while writer.is_staging:
        staged_steps.append(step())
    stage_s = time.perf_counter() - t0
    stalls, busy, writes = [], [], []
    for k in range(2):  # both saves copy into the staged buffers
        t0 = time.perf_counter()
        writer.save(2 + k, drafter, opt, sched, {"epoch": 0})
        stalls.append(time.perf_counter() - t0)
        while writer.in_flight is not None:
            busy.append(step())
        writer.wait()
        writes.append(writer.timings().get("checkpoint_write_s"))
    t0 = time.perf_counter()
    sync_path = save_checkpoint(args.out / "sync", 1, drafter, opt, sched, {"epoch": 0}, keep_last=2)
    sync_s = time.perf_counter() - t0
    size = sum(p.stat().st_size for p in sync_path.rglob("*") if p.is_file())
    record = {
        "device": str(device), "shape": args.shape, "drafter_params": sum(p.numel() for p in drafter.parameters()),
        "checkpoint_bytes": size, "sync_save_s": round(sync_s, 3),
        "stage_call_s": round(stage_call_s, 4), "stage_s": round(stage_s, 3),
        "step_s_median_while_staging": round(statistics.median(staged_steps), 4) if staged_steps else None,
        "async_stall_s": [round(s, 4) for s in stalls], "async_write_s": writes,
        "step_s_median_quiet": round(statistics.median(quiet), 4),
        "step_s_median_during_write": round(statistics.median(busy), 4) if busy else None,
        "steps_during_writes": len(busy),
    }
    print(json.dumps(record))


if __name__ == "__main__":
    main()
