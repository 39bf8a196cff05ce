"""Split placement throughput on one host: T target ranks + D drafter ranks over NCCL, randomly
initialised target of a real shape, the real transport (`train/split/transport.py`) and training step.

    PYTHONPATH=src torchrun --nproc-per-node 2 benchmarks/split_throughput.py --shape qwen3-8b --targets 1

Every micro-batch is `--batch x --seq` tokens with a full loss mask. Reports, from rank 0: tokens/s
(target tokens trained per second), the prediction from the one-GPU rates measured in the same run
(min(T x target rate, D x drafter rate)), transport wait per side and MFU of the whole machine.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from throughput import (SHAPES, add_workload_args, benchmark_vocabulary, drafter_flops, drafter_sections,  # noqa: E402
                        drafter_shape, matmul_peak_tflops, target_config, target_flops)


def main() -> None:
    ap = argparse.ArgumentParser()
    add_workload_args(ap)
    ap.add_argument("--targets", type=int, default=1, help="target ranks; the others train the drafter")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=3)
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM

    from dflash_train.config.load import config_from_dict
    from dflash_train.architectures.family.backend import resolve_backend
    from dflash_train.architectures.drafter import default_target_layer_ids
    from dflash_train.architectures.dflash.model import DFlashDrafter
    from dflash_train.architectures.family.config import make_drafter_config
    from dflash_train.target.capture import TargetCapture, TargetHead
    from dflash_train.architectures.stats import DraftWork
    from dflash_train.architectures.family.blocks import sample_anchors
    from dflash_train.data.batch import Batch
    from dflash_train.train.loop.step import TrainStep
    from dflash_train.train.split.transport import DrafterInbox, SplitLayout, TargetOutbox

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    cuda = torch.cuda.is_available()  # without a GPU: a gloo smoke run of the same code (tiny shape)
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        device = torch.device("cuda", torch.cuda.current_device())
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    dtype = torch.bfloat16 if cuda else torch.float32

    def sync() -> None:
        if cuda:  # the compute stream only: the NCCL stream holds the receives of the next step
            torch.cuda.current_stream().synchronize()
    layout = SplitLayout(world, args.targets)
    drafter_group = dist.new_group(list(range(layout.drafter_ranks))) if layout.drafter_ranks > 1 else None
    shape = SHAPES[args.shape]
    tcfg = target_config(shape)
    ids = default_target_layer_ids(shape["num_hidden_layers"], args.layers)
    width = len(ids) * shape["hidden_size"]
    tokens = args.batch * args.seq
    total = args.warmup + args.steps

    def batch_for(m: int) -> Batch:
        g = torch.Generator().manual_seed(m)
        input_ids = torch.randint(10, shape["vocab_size"], (args.batch, args.seq), generator=g)
        mask = torch.ones_like(input_ids)
        mask[:, : args.seq // 10] = 0
        return Batch(input_ids, mask, torch.full((args.batch,), args.seq)).to(device)

    peak = matmul_peak_tflops() if cuda else 1.0
    result = {"shape": args.shape, "split": f"{layout.target_ranks}+{layout.drafter_ranks}", "batch": args.batch,
              "seq": args.seq, "block": args.block, "anchors": args.anchors, "peak_tflops": round(peak, 1)}
    if layout.is_target(rank):
        with device:
            model = AutoModelForCausalLM.from_config(tcfg, dtype=dtype)
        target = TargetCapture.from_model(model.eval().requires_grad_(False), ids)
        outbox = TargetOutbox(layout, tokens, args.batch, device)
        compute = 0.0
        groups = itertools.repeat([None] * layout.per_step)
        for m, _ in layout.produced(rank, groups, 0):
            if not outbox.next_ticket(m):
                break
            batch = batch_for(m)
            t0 = time.perf_counter()
            hidden = target(batch.input_ids)
            sync()
            compute += time.perf_counter() - t0
            outbox.send(m, batch, hidden)
        outbox.close()
        stats = torch.tensor([compute, outbox.wait_s, outbox.sent], device=device, dtype=torch.float64)
    else:
        head = TargetHead(torch.nn.Embedding(shape["vocab_size"], shape["hidden_size"], device=device,
                                             dtype=dtype).requires_grad_(False),
                          torch.nn.Linear(shape["hidden_size"], shape["vocab_size"], bias=False, device=device,
                                          dtype=dtype).requires_grad_(False))
        dshape, dkwargs = drafter_shape(shape, args)
        dcfg = make_drafter_config(tcfg, num_draft_layers=args.layers, block_size=args.block, target_layer_ids=ids,
                                   mask_token_id=5, **dkwargs)
        drafter = DFlashDrafter(dcfg).to(device)
        benchmark_vocabulary(drafter, head.lm_head.weight)
        if args.compile_drafter:
            drafter.compile_layers()
        cfg = config_from_dict({**drafter_sections(args),
                                "objective": {"max_anchors": args.anchors},
                                "data": {"max_length": args.seq, "token_budget": tokens, "max_batch_size": args.batch}})
        backend = resolve_backend("flex" if cuda else "sdpa", device, args.block)
        step = TrainStep(drafter, head, backend, cfg, 1000, dtype, device, drafter_group, rank,
                         layout.drafter_ranks)
        inbox = DrafterInbox(layout, rank, tokens, args.batch, width, dtype, device)
        inbox.ask(0)
        t_start, wait_start, compute, asking = None, 0.0, 0.0, 0.0
        for s in range(total):
            if s == args.warmup:
                sync()
                t_start, wait_start = time.perf_counter(), inbox.wait_s
            t0 = time.perf_counter()
            if s + 1 < total:
                inbox.ask(s + 1)
            if s >= args.warmup:
                asking += time.perf_counter() - t0
            micro = inbox.take(s)
            t0 = time.perf_counter()
            out = step(micro, s)
            sync()
            if s >= args.warmup:
                compute += time.perf_counter() - t0
        elapsed = time.perf_counter() - t_start
        inbox.close()
        b0 = batch_for(0)
        anchors, keep = sample_anchors(b0.loss_mask.cpu(), b0.lengths.cpu(), args.block, args.anchors,
                                       torch.Generator().manual_seed(0), backend.blocks_multiple_of)
        # received batches have no host copy, so the step counted no blocks: the same draw, on the host
        work = DraftWork.of(anchors, keep, args.block, int(out.counted_per_slot.sum()))
        d_flops = drafter_flops(dshape, tokens, work, args.layers, len(ids))
        stats = torch.tensor([compute, inbox.wait_s - wait_start, elapsed], device=device, dtype=torch.float64)
        result["drafter_ask_s_per_step"] = round(asking / args.steps, 4)
    gathered = [torch.zeros(3, device=device, dtype=torch.float64) for _ in range(world)]
    dist.all_gather(gathered, stats)
    if rank == 0:
        rows = [g.tolist() for g in gathered]
        elapsed = rows[0][2]
        per_step_tokens = tokens * layout.drafter_ranks
        measured = per_step_tokens * args.steps / elapsed
        drafter_rate = tokens * args.steps / rows[0][0]  # one drafter GPU, compute time only
        target_rates = [r[2] * tokens / r[0] for r in rows[layout.drafter_ranks:]]  # micro-batches x tokens / busy s
        t_flops = target_flops(shape, [args.seq] * args.batch, max(ids))
        result.update(
            tokens_per_s=round(measured),
            predicted_tokens_per_s=round(min(layout.target_ranks * min(target_rates), layout.drafter_ranks * drafter_rate)),
            target_rate_per_gpu=round(min(target_rates)), drafter_rate_per_gpu=round(drafter_rate),
            drafter_wait_s_per_step=round(rows[0][1] / args.steps, 4),
            target_wait_s_total=[round(r[1], 2) for r in rows[layout.drafter_ranks:]],
            mfu_machine=round((t_flops + d_flops) * measured / tokens / (world * peak * 1e12), 3),
            drafter_mfu=round(d_flops / (rows[0][0] / args.steps) / (peak * 1e12), 3),
            target_mfu=round(t_flops * min(target_rates) / tokens / (peak * 1e12), 3),
            peak_mem_gib_rank0=round(torch.cuda.max_memory_allocated() / 2**30, 1) if cuda else None,
        )
        print(json.dumps(result), flush=True)
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(result) + "\n")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
