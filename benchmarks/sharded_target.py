"""The cost of a sharded target (`target.sharding: fsdp` or `tp`) against the whole one, on the GPUs of one host.

    PYTHONPATH=src python benchmarks/sharded_target.py --shape qwen3-8b --checkpoint /tmp/q8b --batch 4 --seq 2048
    PYTHONPATH=src torchrun --nproc-per-node 8 benchmarks/sharded_target.py --shape qwen3-27b-class --checkpoint ...
    PYTHONPATH=src torchrun --nproc-per-node 2 benchmarks/sharded_target.py --sharding tp --checkpoint /tmp/q8b

A random target of the shape is saved once to --checkpoint (safetensors, bf16), then loaded sharded over the
ranks (each reading only its rows; tp: its rows and columns) and timed capturing --batch x --seq tokens to its
last captured layer (as a training step does; tp: every rank's batch in turn, so a rank's time covers the group's
batches, as in training). At world size 1 the whole target is loaded too: the capture must be bit-identical
(fsdp; tp: equal to rounding, `max_abs_diff`) and the line reports the sharded path's cost
(`sharded_over_whole`). Also: load seconds, peak host memory and peak GPU memory per rank (rank 0's line;
`--json` appends it), MFU on the layers run (active parameters for MoE)."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from throughput import SHAPES, matmul_peak_tflops, target_config, target_flops, timed


def save_random_target(shape: dict, path: Path) -> None:
    from transformers import AutoModelForCausalLM

    if (path / "config.json").is_file():
        return
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(target_config(shape), dtype=torch.bfloat16)
    model.save_pretrained(path)
    del model
    torch.cuda.empty_cache()


def main() -> None:
    from dflash_train.architectures.drafter import default_target_layer_ids
    from dflash_train.target.shard import SHARD_DIM, load_sharded_target, peak_host_gib, shard_mesh
    from dflash_train.target.tensor_parallel import load_tp_target
    from dflash_train.target.capture import TargetCapture, load_target_model
    from dflash_train.train.processes.dist import DistContext

    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-8b", choices=sorted(SHAPES))
    ap.add_argument("--checkpoint", required=True, help="folder for the random target (written once, then reused)")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=5, help="drafter layers: which target layers are captured")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--compile-target", action="store_true", help="target.compile for both (warmed up first)")
    ap.add_argument("--sharding", default="fsdp", choices=["fsdp", "tp"], help="target.sharding of the sharded load")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.sharding == "tp" and args.compile_target:
        ap.error("--compile-target with --sharding tp: target.compile refuses a tensor-parallel target")
    ctx = DistContext.from_env()
    device = ctx.device(torch.device("cuda"))
    ctx.init(device, alone_too=True)
    shape, path = SHAPES[args.shape], Path(args.checkpoint)
    if ctx.is_main:
        save_random_target(shape, path)
    torch.distributed.barrier()
    peak = matmul_peak_tflops()
    ids = default_target_layer_ids(shape["num_hidden_layers"], args.layers)
    input_ids = torch.randint(10, shape["vocab_size"], (args.batch, args.seq),
                              generator=torch.Generator().manual_seed(ctx.rank)).to(device)
    flops = target_flops(shape, [args.seq] * args.batch, max(ids))
    result = {"shape": args.shape, "sharding": args.sharding, "world": ctx.world, "batch": args.batch, "seq": args.seq,
              "peak_tflops": round(peak, 1)}

    t = time.perf_counter()
    mesh = shard_mesh(device, list(range(ctx.world)), ctx.world)
    load = load_tp_target if args.sharding == "tp" else load_sharded_target
    sharded = TargetCapture.from_model(load(path, torch.bfloat16, device, mesh), ids,
                                       compile=args.compile_target)
    sharded.warm_up(args.seq, one_row=args.batch == 1, several_rows=args.batch > 1)
    result.update(compile_target=args.compile_target, sharded_load_s=round(time.perf_counter() - t, 1), host_peak_gib=round(peak_host_gib(), 2),
                  shard_ranks=mesh[SHARD_DIM].size())
    sharded(input_ids)
    t_sharded, got = timed(lambda: sharded(input_ids), args.repeat)
    result.update(sharded_s=round(t_sharded, 4), sharded_tokens_per_s=round(input_ids.numel() / t_sharded),
                  sharded_mfu=round(flops / t_sharded / 1e12 / peak, 3),
                  peak_gpu_gib=round(torch.cuda.max_memory_allocated() / 2**30, 1))
    if ctx.world == 1:
        whole = TargetCapture.from_model(load_target_model(path, torch.bfloat16, device), ids,
                                         compile=args.compile_target)
        whole.warm_up(args.seq, one_row=args.batch == 1, several_rows=args.batch > 1)
        whole(input_ids)
        t_whole, want = timed(lambda: whole(input_ids), args.repeat)
        result.update(whole_s=round(t_whole, 4), whole_mfu=round(flops / t_whole / 1e12 / peak, 3),
                      sharded_over_whole=round(t_sharded / t_whole, 3), bit_identical=bool(torch.equal(got, want)),
                      max_abs_diff=float((got.float() - want.float()).abs().max()))
    if ctx.is_main:
        print(json.dumps(result))
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(result) + "\n")
    ctx.close()


if __name__ == "__main__":
    main()
