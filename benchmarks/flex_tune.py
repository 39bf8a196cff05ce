"""Time the drafter's flex attention (forward, and forward + backward) under candidate kernel options.

The mask is the training one (`flex_block_mask` on anchors sampled as `TrainStep` samples them); q/k/v
have the drafter's shapes (queries: anchors x block; keys/values: context + anchors x block). Each
candidate is compiled on its own (dynamo reset between them) and checked against the default's output
and gradients, so a faster option that computes something else is reported as wrong, not as a win.

    PYTHONPATH=src python benchmarks/flex_tune.py --batch 4 --seq 2048 --block 16 --anchors 512
"""

from __future__ import annotations

import argparse
import json
import time

import torch

CANDIDATES: list[tuple[str, dict]] = [
    ("default", {}),
    ("fwd_m128_n64_w8_s3", {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3}),
    ("fwd_m128_n128_w8_s2", {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 2}),
    ("bwd_64_128_128_64_w8_s3", {"BLOCK_M1": 64, "BLOCK_N1": 128, "BLOCK_M2": 128, "BLOCK_N2": 64,
                                 "num_warps": 8, "num_stages": 3}),
    ("bwd_32_128_128_32_w4_s3", {"BLOCK_M1": 32, "BLOCK_N1": 128, "BLOCK_M2": 128, "BLOCK_N2": 32,
                                 "num_warps": 4, "num_stages": 3}),
    ("bwd_64_64_64_64_w4_s3", {"BLOCK_M1": 64, "BLOCK_N1": 64, "BLOCK_M2": 64, "BLOCK_N2": 64,
                               "num_warps": 4, "num_stages": 3}),
    ("bwd_prefixed_64_128_w8_s3", {"bwd_BLOCK_M1": 64, "bwd_BLOCK_N1": 128, "bwd_BLOCK_M2": 128,
                                   "bwd_BLOCK_N2": 64, "bwd_num_warps": 8, "bwd_num_stages": 3}),
    ("tma", {"USE_TMA": True}),
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--anchors", type=int, default=512)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--autotune", action="store_true", help="also try mode=max-autotune-no-cudagraphs")
    ap.add_argument("--json", default=None)
    ap.add_argument("--layouts", action="store_true",
                    help="instead of kernel options: static vs dynamic shapes, contiguous vs the drafter's transposed "
                         "views, and lengths known to be multiples of the tile")
    args = ap.parse_args()

    from torch.nn.attention.flex_attention import flex_attention

    from dflash_train.architectures.family.backend import FLEX_TILE
    from dflash_train.architectures.family.mask import flex_block_mask
    from dflash_train.architectures.family.blocks import sample_anchors

    torch._dynamo.config.cache_size_limit = 64
    dev = torch.device("cuda")
    loss_mask = torch.ones(args.batch, args.seq, dtype=torch.long)
    loss_mask[:, : args.seq // 10] = 0
    anchors, keep = sample_anchors(loss_mask, torch.full((args.batch,), args.seq), args.block, args.anchors,
                                   torch.Generator().manual_seed(2), FLEX_TILE // args.block)
    anchors, keep = anchors.to(dev), keep.to(dev)
    mask = flex_block_mask(anchors, keep, args.seq, args.block, tile=FLEX_TILE)
    q_len = anchors.shape[1] * args.block
    g = torch.Generator(device=dev).manual_seed(0)

    def rnd(*shape):
        return torch.randn(*shape, device=dev, dtype=torch.bfloat16, generator=g)

    q = rnd(args.batch, args.heads, q_len, args.head_dim)
    k = rnd(args.batch, args.kv_heads, args.seq + q_len, args.head_dim)
    v = rnd(args.batch, args.kv_heads, args.seq + q_len, args.head_dim)
    grad_out = rnd(args.batch, args.heads, q_len, args.head_dim)
    live = keep.repeat_interleave(args.block, dim=1)[:, None, :, None]  # rows of dropped blocks see nothing

    def timed(fn) -> float:
        fn()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(args.repeat):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - t) / args.repeat * 1e3

    if args.layouts:
        return compare_layouts(args, flex_attention, mask, q, k, v, grad_out, timed)
    candidates = list(CANDIDATES)
    if args.autotune:
        candidates.append(("max_autotune", {"__mode__": "max-autotune-no-cudagraphs"}))
    reference = None
    for name, opts in candidates:
        torch._dynamo.reset()
        opts = dict(opts)
        mode = opts.pop("__mode__", None)
        fn = torch.compile(flex_attention, dynamic=False, fullgraph=True, mode=mode)
        qq, kk, vv = (t.detach().requires_grad_(True) for t in (q, k, v))
        row: dict = {"name": name, "options": opts, "mode": mode}
        try:
            t0 = time.perf_counter()

            def fwd():
                return fn(qq, kk, vv, block_mask=mask, enable_gqa=True, kernel_options=opts or None)

            def fwd_bwd():
                out = fwd()
                out.backward(grad_out)
                return out

            out = fwd_bwd()
            torch.cuda.synchronize()
            row["compile_s"] = round(time.perf_counter() - t0, 1)
            got = [(out * live).float(), qq.grad.float(), kk.grad.float(), vv.grad.float()]
            if reference is None:
                reference = got
            row["max_rel_err"] = max(float((a - b).abs().max() / b.abs().max().clamp_min(1e-6))
                                     for a, b in zip(got, reference))
            with torch.no_grad():
                row["fwd_ms"] = round(timed(fwd), 3)
            qq.grad = kk.grad = vv.grad = None
            row["fwd_bwd_ms"] = round(timed(fwd_bwd), 3)
        except Exception as e:  # an option this torch version rejects: report it, go on
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        print(json.dumps(row), flush=True)
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps({**vars(args), **row}) + "\n")


def compare_layouts(args, flex_attention, mask, q, k, v, grad_out, timed) -> None:
    """Where the training step's flex kernels lose time against this benchmark's: dynamic shapes (the
    kernel cannot assume lengths divisible by its tile), or the drafter's [B, L, H, D] -> [B, H, L, D]
    transposed views."""
    from dflash_train.architectures.family.backend import FLEX_TILE

    def as_views(t):  # the drafter's layout: projections are [B, L, H*D], attention gets a transposed view
        return t.transpose(1, 2).contiguous().transpose(1, 2)

    def tiled(fn):  # lengths as (tiles x FLEX_TILE) inside the compiled region: divisibility is symbolic
        def run(q, k, v, block_mask, enable_gqa, kernel_options=None):
            b, h, lq, d = q.shape
            q = q.view(b, h, lq // FLEX_TILE, FLEX_TILE, d).flatten(2, 3)
            k = k.view(b, k.shape[1], k.shape[2] // FLEX_TILE, FLEX_TILE, d).flatten(2, 3)
            v = v.view(b, v.shape[1], v.shape[2] // FLEX_TILE, FLEX_TILE, d).flatten(2, 3)
            return fn(q, k, v, block_mask=block_mask, enable_gqa=enable_gqa, kernel_options=kernel_options)
        return run

    for name, dynamic, views, tile_trick, opts in [("static_contiguous", False, False, False, None),
                                                   ("dynamic_contiguous", True, False, False, None),
                                                   ("static_views", False, True, False, None),
                                                   ("dynamic_views", True, True, False, None),
                                                   ("dynamic_views_tiled", True, True, True, None),
                                                   ("dynamic_views_is_divisible", True, True, False,
                                                    {"IS_DIVISIBLE": True})]:
        torch._dynamo.reset()
        fn = tiled(flex_attention) if tile_trick else flex_attention
        fn = torch.compile(fn, dynamic=dynamic, fullgraph=True)
        base = [as_views(t) if views else t for t in (q, k, v)]
        qq, kk, vv = (t.detach().requires_grad_(True) for t in base)
        go = as_views(grad_out) if views else grad_out
        row = {"name": name}
        try:
            def fwd():
                return fn(qq, kk, vv, block_mask=mask, enable_gqa=True, kernel_options=opts)

            def fwd_bwd():
                out = fwd()
                out.backward(go)
                return out

            t0 = time.perf_counter()
            fwd_bwd()
            torch.cuda.synchronize()
            row["compile_s"] = round(time.perf_counter() - t0, 1)
            with torch.no_grad():
                row["fwd_ms"] = round(timed(fwd), 3)
            row["fwd_bwd_ms"] = round(timed(fwd_bwd), 3)
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
