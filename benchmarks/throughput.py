"""Training throughput on one GPU with a randomly initialised target of a real shape.

    PYTHONPATH=src python benchmarks/throughput.py --shape qwen3-8b --batch 4 --seq 2048 --block 16 --anchors 512
    PYTHONPATH=src python benchmarks/throughput.py --part target --shape qwen3-8b --batch 4 --seq 2048 --compile-target

Reports tokens/s (target tokens), time per part, MFU against a measured bf16 matmul peak, and peak
memory. FLOP accounting: the training loop's own (src/dflash_train/train/loop/flops.py, docs/guide/runs.md
"Efficiency"): matmuls + attention over unmasked entries; target layers up to the last captured one; drafter
forward + backward (weights and inputs) over the blocks the timed step drafted, lm_head forward + input
gradient on counted rows; no weight gradient for frozen parts. With `--draft-vocab N` the drafter's own trained
lm_head [N, hidden] instead: forward, input and weight gradient (its backward also forms the logits again,
which counts as no useful FLOP).

    PYTHONPATH=src python benchmarks/throughput.py --shape qwen3-8b --compile-target --compile-drafter --draft-vocab 32768

`--target-fp8` (target.quantize=fp8) and `--drafter-fp8` (drafter.fp8) run those matmuls in FP8: the target's
decoder linears up to the last captured layer; the drafter's q/k/v/o, MLP and fc, forward and both gradients.
The attention products and the lm_head stay bf16. MFU stays against the measured bf16 peak (so an FP8 run can
pass 1); the result names the FP8 matmuls, their share of the FLOPs, and the measured FP8 peak beside it.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from pathlib import Path

import torch

SHAPES = {
    # hidden, layers, heads, kv heads, head_dim, intermediate, vocab
    "qwen3-8b": dict(hidden_size=4096, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                     head_dim=128, intermediate_size=12288, vocab_size=151936),
    # the embedded SmolLM2-135M-Instruct's dimensions (tied embeddings): the quality bench's target
    "smollm2-class": dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                          head_dim=64, intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True),
    "tiny": dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 intermediate_size=128, vocab_size=1000),  # CPU smoke runs of the benchmark code
    "qwen3-27b-class": dict(hidden_size=5120, num_hidden_layers=64, num_attention_heads=64, num_key_value_heads=8,
                            head_dim=128, intermediate_size=25600, vocab_size=151936),
    "llama3-70b-class": dict(hidden_size=8192, num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                             head_dim=128, intermediate_size=28672, vocab_size=128256, tie_word_embeddings=False),
    # Qwen3-30B-A3B's config.json: every layer a 128-expert MoE, 8 experts per token, 768 wide; untied lm_head.
    # `intermediate_size` (the config's dense MLP width, used by no layer here) is the drafter's default MLP.
    "qwen3-30b-a3b-class": dict(hidden_size=2048, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                                head_dim=128, intermediate_size=6144, vocab_size=151936, num_experts=128,
                                num_experts_per_tok=8, moe_intermediate_size=768, tie_word_embeddings=False),
    "tiny-moe": dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                     intermediate_size=128, vocab_size=1000, num_experts=8, num_experts_per_tok=2,
                     moe_intermediate_size=32),  # CPU smoke runs of the MoE path
}


def target_config(shape: dict):
    """The HF config of a shape: Qwen3-MoE when it has experts, else Qwen3."""
    from transformers import Qwen3Config, Qwen3MoeConfig

    if "num_experts" in shape:
        return Qwen3MoeConfig(**shape, max_position_embeddings=40960, decoder_sparse_step=1, mlp_only_layers=[])
    return Qwen3Config(**shape, max_position_embeddings=40960)


def matmul_peak_tflops() -> float:
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    times = []
    for _ in range(20):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        a @ b
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    return 2 * n**3 / sorted(times)[len(times) // 2] / 1e12


def fp8_matmul_peak_tflops() -> float:
    """`torch._scaled_mm` (e4m3, row-wise scales, bf16 out) on 8192^3: the ceiling of the FP8 matmuls."""
    n = 8192
    a = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn).t()
    sa, sb = torch.ones(n, 1, device="cuda"), torch.ones(1, n, device="cuda")

    def mm():
        return torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)

    for _ in range(3):
        mm()
    t, _ = back_to_back(mm, 20)
    return 2 * n**3 / t / 1e12


# The FLOP accounting is the training loop's (src/dflash_train/train/loop/flops.py): one function for both.
from dflash_train.train.loop.flops import (drafter_flop_parts, drafter_flops, layer_matmul_params,  # noqa: E402,F401
                                      layer_resident_params, own_flops, target_flop_parts, target_flops)


def fp8_accounting(args, target_parts: dict, drafter_parts: dict, peak_bf16: float) -> dict:
    """Which matmuls ran in FP8 and their share of the counted FLOPs; MFU stays against the bf16 peak."""
    fp8 = []
    fp8_flops = 0.0
    if args.target_fp8:
        fp8.append("target decoder linears q/k/v/o, gate/up/down (layers 0..last captured), forward")
        fp8_flops += target_parts.get("linears", 0.0)
    if args.drafter_fp8:
        gw_fp8 = args.fp8_grad_weight != "bf16"
        fp8.append("drafter fc, q/k/v/o, gate/up/down: forward, grad input" + (", grad weight" if gw_fp8 else ""))
        fp8_flops += drafter_parts.get("linears", 0.0) * (1.0 if gw_fp8 else 2.0 / 3.0)
    total = sum(target_parts.values()) + sum(drafter_parts.values())
    out = {"target_fp8": args.target_fp8, "drafter_fp8": args.drafter_fp8, "fp8_matmuls": fp8,
           "fp8_grad_weight": args.fp8_grad_weight if args.drafter_fp8 else None,
           "fp8_flop_share": round(fp8_flops / total, 3) if total else 0.0,
           "mfu_against": f"measured bf16 matmul peak ({peak_bf16:.0f} TFLOP/s); attention and lm_head stay bf16"}
    if fp8:
        out["fp8_peak_tflops"] = round(fp8_matmul_peak_tflops(), 1)
    return out


def use_fp8(args, target, drafter) -> None:
    """--target-fp8 / --drafter-fp8: what target.quantize=fp8 and drafter.fp8 do in training."""
    from dflash_train.target.quantize import quantize_decoder_layers
    from dflash_train.accel.fp8_training import use_fp8_training
    from dflash_train.target.hf_model import decoder_of

    if args.target_fp8 and target is not None:
        quantize_decoder_layers(decoder_of(target.model).layers, max(target.layer_ids) + 1,
                                target.embed_tokens.weight.device)
        torch.cuda.empty_cache()
    if args.drafter_fp8 and drafter is not None:
        use_fp8_training(drafter, args.fp8_grad_weight)


def add_workload_args(ap: argparse.ArgumentParser) -> None:
    """The target shape, micro-batch and drafter recipe every throughput benchmark measures."""
    ap.add_argument("--shape", default="qwen3-8b", choices=sorted(SHAPES))
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--anchors", type=int, default=512)
    ap.add_argument("--layers", type=int, default=5)
    ap.add_argument("--compile-drafter", action="store_true",
                    help="drafter.compile: the drafter's layers compiled (in the first, untimed steps)")
    add_drafter_shape_args(ap)
    ap.add_argument("--json", default=None, help="append the result line to this file")


def add_drafter_shape_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--draft-intermediate", type=int, default=None, help="drafter MLP width (default: the target's)")
    ap.add_argument("--draft-heads", type=int, default=None, help="drafter query heads (default: the target's)")
    ap.add_argument("--draft-kv-heads", type=int, default=None, help="drafter key/value heads (default: the target's)")
    ap.add_argument("--draft-vocab", type=int, default=0,
                    help="drafter.draft_vocab_size: the drafter's own lm_head over this many tokens (0: the target's)")


def drafter_shape(shape: dict, args) -> tuple[dict, dict]:
    """(the drafter's layer shape for the FLOP count, make_drafter_config keyword arguments)."""
    kwargs = {"intermediate_size": args.draft_intermediate, "num_attention_heads": args.draft_heads,
              "num_key_value_heads": args.draft_kv_heads}
    merged = dict(shape)
    for key, value in kwargs.items():
        if value:
            merged[key] = value
    if args.draft_vocab:
        kwargs["draft_vocab_size"] = merged["draft_vocab_size"] = args.draft_vocab
    return merged, kwargs


def benchmark_vocabulary(drafter, target_lm_head: torch.Tensor) -> None:
    """A reduced draft vocabulary for a benchmark drafter: the first N target ids (the data is random, so which
    tokens make no difference to the cost), the head initialised from the target's rows as training does."""
    if drafter.draft_vocab_size:
        drafter.set_draft_vocabulary(torch.arange(drafter.draft_vocab_size), target_lm_head)


def drafter_sections(args) -> dict:
    """The benchmark config's `drafter` section, and its architecture's own section (`dflash2`)."""
    architecture = getattr(args, "architecture", "dflash")
    sections = {"drafter": {"architecture": architecture, "block_size": args.block, "num_draft_layers": args.layers,
                            "draft_vocab_size": args.draft_vocab}}
    if architecture == "dflash2":
        sections["dflash2"] = {"selector_top_k": args.selector_top_k, "selector_codebooks": args.selector_codebooks}
    return sections


def preflight_estimate(cfg, target_model, drafter, tcfg, dcfg, ids: list[int]) -> dict:
    """The trainer's preflight prediction for this colocated shape (train/plan/preflight.py, activation_memory.py):
    weights and optimizer state (bf16 target, 16 bytes a drafter parameter) plus the activations of its micro-batch,
    no margin, to set beside the measured `peak_mem_gib` (the allocator's peak)."""
    from dflash_train.train.plan.activation_memory import activation_estimate
    from dflash_train.train.plan.preflight import MARGIN, needed_bytes

    trained = sum(p.numel() for p in drafter.parameters() if p.requires_grad)
    weights = needed_bytes(sum(p.numel() for p in target_model.parameters()), torch.bfloat16, trained, "colocated",
                           target_bytes_saved=0) - MARGIN
    activations = activation_estimate("colocated", cfg, tcfg, dcfg, ids, torch.bfloat16, torch.bfloat16, "cuda",
                                      trained)
    return {"preflight_estimate_gib": round((weights + activations.total) / 2**30, 1),
            "preflight_activations": activations.describe()}


def add_inductor_options(items: list[str]) -> None:
    """`--inductor-option KEY=VALUE`: into the compile layer's options of every inductor compile."""
    import ast

    from dflash_train.accel import compile as compile_layer

    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--inductor-option {item!r}: write KEY=VALUE, e.g. loop_ordering_after_fusion=False")
        compile_layer.INDUCTOR_OPTIONS[key] = ast.literal_eval(value)


def back_to_back(fn, repeat: int) -> tuple[float, list[float]]:
    """Seconds per call over `repeat` calls with one synchronisation at the end, as the training loop runs
    them (the host queues the next step while the GPU finishes the last one), and each call's seconds on the
    GPU's timeline (CUDA events between calls: no synchronisation in between), so that one slow call shows."""
    torch.cuda.synchronize()
    events = [torch.cuda.Event(enable_timing=True) for _ in range(repeat + 1)]
    t = time.perf_counter()
    events[0].record()
    for k in range(repeat):
        fn()
        events[k + 1].record()
    torch.cuda.synchronize()
    mean = (time.perf_counter() - t) / repeat
    return mean, [events[k].elapsed_time(events[k + 1]) / 1e3 for k in range(repeat)]


def timed(fn, repeat: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeat):
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2], out


class _Frozen:
    """The shared pieces a drafter-only rank holds: the target's embeddings and lm_head, and hidden
    states that arrive from target ranks (random here)."""

    def __init__(self, shape: dict, hidden: torch.Tensor):
        v, h = shape["vocab_size"], shape["hidden_size"]
        self.embed_tokens = torch.nn.Embedding(v, h, device="cuda", dtype=torch.bfloat16).requires_grad_(False)
        self.lm_head = torch.nn.Linear(h, v, bias=False, device="cuda", dtype=torch.bfloat16).requires_grad_(False)
        self.hidden = hidden

    def __call__(self, _ids):
        return self.hidden


def measure_one_side(args) -> None:
    from transformers import AutoModelForCausalLM

    from dflash_train.config.load import config_from_dict
    from dflash_train.architectures.family.backend import resolve_backend
    from dflash_train.architectures.drafter import default_target_layer_ids
    from dflash_train.architectures.dflash.model import DFlashDrafter
    from dflash_train.architectures.family.config import make_drafter_config
    from dflash_train.target.capture import TargetCapture
    from dflash_train.data.batch import Batch
    from dflash_train.train.loop.step import TrainStep

    from dflash_train.accel import compile as compile_layer

    compile_layer.configure_cache(args.cache_dir, fresh=args.fresh_cache)
    compile_layer.watch_recompiles()
    if args.compile_only:
        compile_layer.restrict_to(tuple(args.compile_only.split(",")))
    started = time.time()
    peak = matmul_peak_tflops() if not args.precompile_only else 0.0
    shape = SHAPES[args.shape]
    tcfg = target_config(shape)
    ids = default_target_layer_ids(shape["num_hidden_layers"], args.layers)
    g = torch.Generator().manual_seed(0)
    input_ids = torch.randint(10, shape["vocab_size"], (args.batch, args.seq), generator=g)
    loss_mask = torch.ones_like(input_ids)
    loss_mask[:, : args.seq // 10] = 0
    batch = Batch(input_ids, loss_mask, torch.full((args.batch,), args.seq)).to(torch.device("cuda"))
    lengths = [args.seq] * args.batch
    tokens = sum(lengths)
    result = {"shape": args.shape, "part": args.part, "batch": args.batch, "seq": args.seq, "block": args.block,
              "anchors": args.anchors, "peak_tflops": round(peak, 1)}
    if args.part == "target":
        # A precompile child needs the weights' shapes and dtype only: uninitialised memory, no init kernels.
        with torch.device("meta" if args.precompile_only else "cuda"):
            model = AutoModelForCausalLM.from_config(tcfg, dtype=torch.bfloat16)
        if args.precompile_only:
            model.to_empty(device="cuda")
        target = TargetCapture.from_model(model.eval().requires_grad_(False), ids, compile=args.compile_target)
        use_fp8(args, target, None)
        result.update(compile_target=args.compile_target, **target.warm_up(args.seq, one_row=args.batch == 1, several_rows=args.batch > 1,
                                                                     with_final=False))
        if args.precompile_only:
            return report_precompile(args, result, started)
        target(batch.input_ids)
        before = compile_layer.recompiles(), compile_layer.graphs_compiled()
        t, _ = timed(lambda: target(batch.input_ids), args.repeat)
        parts = target_flop_parts(shape, lengths, max(ids))
        result.update(fp8_accounting(args, parts, {}, peak))
        result.update(seconds=round(t, 4), tokens_per_s=round(tokens / t),
                      mfu=round(sum(parts.values()) / t / 1e12 / peak, 3),
                      recompiles_measured=compile_layer.recompiles() - before[0],
                      graphs_compiled_measured=compile_layer.graphs_compiled() - before[1])
    else:
        dshape, dkwargs = drafter_shape(shape, args)
        dcfg = make_drafter_config(tcfg, num_draft_layers=args.layers, block_size=args.block, target_layer_ids=ids,
                                   mask_token_id=5, **dkwargs)
        drafter = DFlashDrafter(dcfg).cuda()
        use_fp8(args, None, drafter)
        if args.compile_drafter:
            drafter.compile_layers()
        result.update(compile_drafter=args.compile_drafter, draft_vocab=args.draft_vocab)
        hidden = torch.randn(args.batch, args.seq, len(ids) * shape["hidden_size"], device="cuda", dtype=torch.bfloat16)
        frozen = _Frozen(shape, hidden)
        benchmark_vocabulary(drafter, frozen.lm_head.weight)
        cfg = config_from_dict({**drafter_sections(args),
                                "objective": {"max_anchors": args.anchors, "head_gradient": args.head_gradient},
                                "data": {"max_length": args.seq, "token_budget": args.seq * args.batch}},
                               overrides=getattr(args, "set", None) or None)
        if args.draft_vocab:
            result["head_gradient_kept"] = cfg.keeps_head_gradient
        backend = resolve_backend("flex", torch.device("cuda"), args.block)
        step = TrainStep(drafter, frozen, backend, cfg, 1000, torch.bfloat16, torch.device("cuda"))
        step(batch, 0)
        step(batch, 1)
        if args.precompile_only:
            return report_precompile(args, result, started)
        t, stats = timed(lambda: step(batch, 2), args.repeat)
        parts = drafter_flop_parts(dshape, tokens, stats.work, args.layers, len(ids))
        result.update(fp8_accounting(args, {}, parts, peak))
        result.update(seconds=round(t, 4), tokens_per_s=round(tokens / t),
                      mfu=round(sum(parts.values()) / t / 1e12 / peak, 3))
    result["peak_mem_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 1)
    print(json.dumps(result))
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps(result) + "\n")


def report_precompile(args, result: dict, started: float) -> None:
    """A precompile child's line: its share compiled into the shared cache, how long it took, what it compiled."""
    from dflash_train.accel import compile as compile_layer

    result.update(precompile_only=args.compile_only or True, precompile_s=round(time.time() - started, 1),
                  **compile_layer.compile_phase_totals(), **compile_layer.cache_stats())
    print(json.dumps(result))


def precompile_commands(args) -> dict[str, list[str]]:
    """The children of `--precompile-fanout`: the target's layer graphs; the drafter's attention inputs; its
    output + MLP and the loss (flex attention in both drafter children: an eager flex call is an error)."""
    base = [sys.executable, os.path.abspath(__file__), "--shape", args.shape, "--batch", str(args.batch),
            "--seq", str(args.seq), "--block", str(args.block), "--anchors", str(args.anchors),
            "--layers", str(args.layers), "--cache-dir", args.cache_dir, "--precompile-only", "--repeat", "1"]
    commands = {}
    if args.compile_target:
        commands["target"] = base + ["--part", "target", "--compile-target"]
    if args.compile_drafter:
        commands["drafter-inputs"] = base + ["--part", "drafter", "--compile-drafter",
                                             "--compile-only", "attention_inputs,flex_attention"]
        commands["drafter-rest"] = base + ["--part", "drafter", "--compile-drafter",
                                           "--compile-only", "output_and_mlp,flex_attention,ce_chunk"]
    return commands


def record_kernel_builds() -> dict[str, float] | None:
    """Each Triton kernel's build time in a compile worker (seconds, by kernel name), as inductor reports it to
    its metrics; None where this torch reports none."""
    from torch._inductor import async_compile

    report = getattr(async_compile, "_add_triton_kernel_info", None)
    if report is None:
        print("note: this torch reports no per-kernel build times; the line carries no kernel_* keys", file=sys.stderr)
        return None
    builds: dict[str, float] = {}

    def recording(kernel_name, info, _report=report):
        if "compile_time_us" in info:
            builds[kernel_name] = info["compile_time_us"] / 1e6
        return _report(kernel_name, info)

    async_compile._add_triton_kernel_info = recording
    return builds


def kernel_build_summary(builds: dict[str, float]) -> dict:
    """The count, sum and the slowest eight of the kernels built (a cold compile's long poles)."""
    slowest = sorted(builds.items(), key=lambda kv: -kv[1])[:8]
    return {"kernels_built": len(builds), "kernel_build_sum_s": round(sum(builds.values()), 2),
            "kernel_builds_slowest": [[name, round(t, 2)] for name, t in slowest]}


def main() -> None:
    ap = argparse.ArgumentParser()
    add_workload_args(ap)
    ap.add_argument("--repeat", type=int, default=5)
    from dflash_train.architectures import registry

    ap.add_argument("--architecture", default="dflash", choices=registry.names(),
                    help="the drafter architecture (full step only; dflash2: reference convolution/selector sizes; "
                         "the others: their sections' defaults)")
    ap.add_argument("--selector-top-k", type=int, default=32,
                    help="dflash2.selector_top_k of --architecture dflash2 (its candidates per slot)")
    ap.add_argument("--selector-codebooks", default="free", choices=("free", "factored"),
                    help="dflash2.selector_codebooks of --architecture dflash2")
    ap.add_argument("--profile", action="store_true",
                    help="print the top CUDA kernels of one drafter step, then of one target capture")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a dotted config override of the benchmark's run config, e.g. dspark.loss=dpard (repeat)")
    ap.add_argument("--label", default=None, help="the result line's name (default: the architecture)")
    ap.add_argument("--cache-dir", default=None, help="inductor cache directory (see --fresh-cache)")
    ap.add_argument("--fresh-cache", action="store_true", help="empty the inductor cache first: a cold compile")
    ap.add_argument("--late-compile-workers", action="store_true",
                    help="leave inductor's compile workers to start at the first compile (by default they start while "
                         "the models build, as in the trainer)")
    ap.add_argument("--part", default="both", choices=["both", "target", "drafter"],
                    help="measure one side alone (the per-GPU rates of a split placement)")
    ap.add_argument("--compile-target", action="store_true",
                    help="target.compile: the target's decoder layers compiled (warmed up before timing)")
    ap.add_argument("--precompile-fanout", action="store_true",
                    help="child processes compile shares of the graphs into --cache-dir while this one builds "
                         "its models; the warm-up waits for them, then takes the graphs from the cache")
    ap.add_argument("--fanout-log-dir", default=None, help="the precompile children's logs (default: a temp dir)")
    ap.add_argument("--fanout-start", choices=("fork", "spawn"), default="fork",
                    help="--precompile-fanout's children: forked with this process's imports, or new processes")
    ap.add_argument("--precompile-only", action="store_true", help=argparse.SUPPRESS)  # a child of the fan-out
    ap.add_argument("--compile-only", default=None, help=argparse.SUPPRESS)  # its share: name parts, comma-separated
    ap.add_argument("--cold-compile-levers", choices=("on", "off"), default=None,
                    help="the A/B of the cold-compile levers (DFLASH_TRAIN_COLD_COMPILE_LEVERS=1/0; default: the "
                         "environment's, else off): inductor's FX pattern passes off, cache keys hashed early")
    ap.add_argument("--inductor-option", action="append", default=[], metavar="KEY=VALUE",
                    help="add an inductor option (a Python literal) to every compile, e.g. "
                         "loop_ordering_after_fusion=False: a compile-time lever on trial (repeatable)")
    ap.add_argument("--target-fp8", action="store_true",
                    help="target.quantize=fp8: the target's decoder linears up to the last captured layer in FP8")
    ap.add_argument("--drafter-fp8", action="store_true",
                    help="drafter.fp8: the drafter's q/k/v/o, MLP and fc trained with FP8 matmuls")
    ap.add_argument("--head-gradient", default="auto", choices=("auto", "recompute", "keep"),
                    help="objective.head_gradient: with --draft-vocab, the trained head's weight gradient formed "
                         "again in backward or from the forward's kept [rows, vocab] gradient rows")
    ap.add_argument("--fp8-grad-weight", default="tensorwise", choices=("rowwise", "tensorwise", "bf16"),
                    help="drafter.fp8_grad_weight: how --drafter-fp8 runs the weight-gradient matmuls")
    args = ap.parse_args()
    if args.head_gradient == "keep" and not args.draft_vocab:
        ap.error("--head-gradient keep: needs --draft-vocab (the target's frozen head has no weight gradient)")
    if args.selector_top_k != 32 and args.architecture != "dflash2":
        ap.error("--selector-top-k: a dflash2 key; add --architecture dflash2")
    if args.selector_codebooks != "free" and args.architecture != "dflash2":
        ap.error("--selector-codebooks: a dflash2 key; add --architecture dflash2")
    if args.draft_vocab and args.architecture != "dflash":
        ap.error("--draft-vocab: a reduced draft vocabulary is implemented for --architecture dflash only")
    from_config = args.architecture not in ("dflash", "dflash2")  # built from the run config's sections
    if from_config and (args.draft_intermediate or args.draft_heads or args.draft_kv_heads):
        ap.error(f"--draft-intermediate/--draft-heads/--draft-kv-heads: not taken with --architecture {args.architecture}")
    if from_config and args.part != "both":
        ap.error(f"--part: --architecture {args.architecture} measures the full step only")
    if args.cold_compile_levers:
        os.environ["DFLASH_TRAIN_COLD_COMPILE_LEVERS"] = "1" if args.cold_compile_levers == "on" else "0"
    add_inductor_options(args.inductor_option)
    if args.part != "both":
        return measure_one_side(args)
    if args.precompile_fanout and not args.cache_dir:
        ap.error("--precompile-fanout: needs --cache-dir (the children and this process share it)")

    from transformers import AutoModelForCausalLM

    from dflash_train.config.load import config_from_dict
    from dflash_train.architectures import architecture, reads_target_final
    from dflash_train.architectures.family.backend import resolve_backend
    from dflash_train.architectures.drafter import default_target_layer_ids
    from dflash_train.architectures.dflash.model import DFlashDrafter
    from dflash_train.architectures.family.config import make_drafter_config
    from dflash_train.target.capture import TargetCapture
    from dflash_train.data.batch import Batch
    from dflash_train.train.loop.step import TrainStep

    from dflash_train.accel import compile as compile_layer

    compile_layer.configure_cache(args.cache_dir, fresh=args.fresh_cache)
    fanout = None
    if args.precompile_fanout:
        import tempfile

        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from precompile_fanout import Fanout

        commands = precompile_commands(args)
        logs = Path(args.fanout_log_dir or tempfile.mkdtemp(prefix="fanout-"))
        workers = max(1, compile_layer.usable_cores() // max(1, len(commands)))
        if args.fanout_start == "fork":  # before CUDA starts in this process: the children skip the imports
            jobs = {name: functools.partial(measure_one_side, ap.parse_args(argv[2:]))
                    for name, argv in commands.items()}
            fanout = Fanout.fork(jobs, logs, Path(args.cache_dir), workers)
        else:
            fanout = Fanout.start(commands, logs, Path(args.cache_dir), workers)
    kernel_builds = record_kernel_builds()
    if not args.late_compile_workers:  # as the trainer does: the pool starts while the models build
        compile_layer.start_compile_workers()
    process_start = float(os.environ.get("BENCH_START_TS", time.time()))
    peak = matmul_peak_tflops()
    shape = SHAPES[args.shape]
    t0 = time.perf_counter()
    tcfg = target_config(shape)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(tcfg, dtype=torch.bfloat16)
    model.eval().requires_grad_(False)
    ids = default_target_layer_ids(shape["num_hidden_layers"], args.layers)
    target = TargetCapture.from_model(model, ids, compile=args.compile_target)
    dshape, dkwargs = drafter_shape(shape, args)
    if args.architecture == "dflash2":
        from dflash_train.architectures.dflash2.config import make_dflash2_config
        from dflash_train.architectures.dflash2.model import DFlash2Drafter

        dcfg = make_dflash2_config(tcfg, num_draft_layers=args.layers, block_size=args.block, target_layer_ids=ids,
                                   mask_token_id=5, selector_top_k=args.selector_top_k,
                                   selector_codebooks=args.selector_codebooks, **dkwargs)
        drafter = DFlash2Drafter(dcfg).cuda()
    cfg = config_from_dict({**drafter_sections(args),
                            "objective": {"max_anchors": args.anchors, "head_gradient": args.head_gradient},
                            "data": {"max_length": args.seq, "token_budget": args.seq * args.batch,
                                     "max_batch_size": args.batch}},
                           overrides=args.set or None)
    if args.architecture not in ("dflash", "dflash2"):  # built as the trainer builds it, from the run's config
        arch = architecture(args.architecture)
        dcfg = arch.config_for_run(tcfg, cfg, ids, 5)
        drafter = arch.drafter_class(dcfg).cuda()
    elif args.architecture == "dflash":
        dcfg = make_drafter_config(tcfg, num_draft_layers=args.layers, block_size=args.block, target_layer_ids=ids,
                                   mask_token_id=5, **dkwargs)
        drafter = DFlashDrafter(dcfg).cuda()
    benchmark_vocabulary(drafter, target.lm_head.weight)
    use_fp8(args, target, drafter)
    if args.compile_drafter:
        drafter.compile_layers()
    build_s = time.perf_counter() - t0

    estimate = preflight_estimate(cfg, model, drafter, tcfg, dcfg, ids)
    backend = resolve_backend("flex", torch.device("cuda"), args.block)
    step = TrainStep(drafter, target, backend, cfg, 1000, torch.bfloat16, torch.device("cuda"))
    g = torch.Generator().manual_seed(0)
    input_ids = torch.randint(10, shape["vocab_size"], (args.batch, args.seq), generator=g)
    loss_mask = torch.ones_like(input_ids)
    loss_mask[:, : args.seq // 10] = 0  # a prompt
    batch = Batch(input_ids, loss_mask, torch.full((args.batch,), args.seq)).to(torch.device("cuda"))
    lengths = [args.seq] * args.batch

    torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    fanout_info = fanout.wait(600) if fanout is not None else {}
    # The trainer's warm-up order: the target first, then the drafter; batches of several rows only.
    # the layers a capture runs: --target-fp8 quantises those, and the layers past them would add graphs
    target_warm = target.warm_up(args.seq, one_row=args.batch == 1, several_rows=args.batch > 1,
                                 with_final=reads_target_final(cfg))
    step(batch, 0)
    torch.cuda.synchronize()
    first_step_s = time.perf_counter() - t
    start_to_first_step_s = time.time() - process_start
    step(batch, 1)

    reads_final = reads_target_final(cfg)  # the step runs the target to its final norm: timed and counted so
    t_target, _ = timed(lambda: target.capture(batch.input_ids, with_final=True) if reads_final
                        else target(batch.input_ids), args.repeat)
    t_step, stats = timed(lambda: step(batch, 2), args.repeat)
    t_loop, loop_steps = back_to_back(lambda: step(batch, 2), args.repeat)
    peak_mem = torch.cuda.max_memory_allocated() / 2**30

    # Drafter alone: the same step with the target's output precomputed.
    hidden = target(batch.input_ids)
    final_capture = target.capture(batch.input_ids, with_final=True) if reads_final else None
    real_target = step.target
    class Precomputed:
        embed_tokens, lm_head = real_target.embed_tokens, real_target.lm_head
        def __call__(self, _ids):
            return hidden
        def capture(self, _ids, with_final=False):
            return final_capture if with_final else (hidden, None)
    step.target = step.objective.target = Precomputed()  # the objective runs the target it holds
    t_drafter, _ = timed(lambda: step(batch, 3), args.repeat)
    profile_groups: dict[str, dict[str, float]] = {}  # --profile: each part's kernel milliseconds by kind
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from kernel_groups import describe, kernel_groups, profiled_kernels

        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            step(batch, 4)
            torch.cuda.synchronize()
        averages = prof.key_averages()
        print(averages.table(sort_by="cuda_time_total", row_limit=35, max_name_column_width=70))
        # the kernels themselves, by their own time: the many small ones that the table above leaves out
        print(averages.table(sort_by="self_device_time_total", row_limit=90, max_name_column_width=90))
        profile_groups["drafter"] = kernel_groups(profiled_kernels(prof), t_drafter * 1000)
        print("-- the drafter's step by kind:", describe(profile_groups["drafter"], t_drafter * 1000))
    step.target = step.objective.target = real_target
    if args.profile:  # and the target's capture alone
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            target(batch.input_ids)
            torch.cuda.synchronize()
        print("-- the target's capture, kernels by their own time")
        print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=40, max_name_column_width=90))
        profile_groups["target"] = kernel_groups(profiled_kernels(prof), t_target * 1000)
        print("-- the target's capture by kind:", describe(profile_groups["target"], t_target * 1000))

    tokens = sum(lengths)
    target_parts = target_flop_parts(shape, lengths, shape["num_hidden_layers"] - 1 if reads_final else max(ids))
    # the timed step's blocks, with the architecture's own modules (its `step_flops` hook)
    drafter_parts = drafter_flop_parts(dshape, tokens, stats.work, args.layers, len(ids), own_flops(drafter))
    f_target, f_drafter = sum(target_parts.values()), sum(drafter_parts.values())
    result = {
        "architecture": args.architecture, "name": args.label or args.architecture, "overrides": args.set,
        "draft_vocab": args.draft_vocab, "shape": args.shape, "batch": args.batch, "seq": args.seq, "block": args.block, "anchors": args.anchors,
        "peak_tflops": round(peak, 1), "build_s": round(build_s, 1), "first_step_s": round(first_step_s, 1),
        "start_to_first_step_s": round(start_to_first_step_s, 1), "fresh_cache": args.fresh_cache,
        "early_compile_workers": not args.late_compile_workers,
        "cold_compile_levers": compile_layer.cold_compile_levers_on(), "inductor_options": args.inductor_option,
        **compile_layer.compile_phase_totals(),
        **compile_layer.cache_stats(), "compile_target": args.compile_target,
        "compile_drafter": args.compile_drafter, **target_warm, **fanout_info,
        "target_s": round(t_target, 4), "drafter_s": round(t_drafter, 4), "step_s": round(t_step, 4),
        "loop_step_s": round(t_loop, 4), "loop_steps_s": [round(x, 4) for x in loop_steps],
        "tokens_per_s": round(tokens / t_step), "target_mfu": round(f_target / t_target / 1e12 / peak, 3),
        "drafter_mfu": round(f_drafter / t_drafter / 1e12 / peak, 3),
        "step_mfu": round((f_target + f_drafter) / t_step / 1e12 / peak, 3),
        "peak_mem_gib": round(peak_mem, 1), **estimate,
        **fp8_accounting(args, target_parts, drafter_parts, peak),
        "drafter_tflop_parts": {k: round(v / 1e12, 2) for k, v in drafter_parts.items()},
        "counted_rows": stats.work.counted_rows, "target_positions": stats.work.target_positions,
    }
    if kernel_builds is not None:
        result.update(kernel_build_summary(kernel_builds))
    if args.architecture == "dflash2":
        result["selector_top_k"] = args.selector_top_k
        result["selector_codebooks"] = args.selector_codebooks
    if args.draft_vocab:
        result["head_gradient_kept"] = cfg.keeps_head_gradient
    if profile_groups:
        result["profile_ms"] = profile_groups
    print(json.dumps(result))
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps(result) + "\n")
    if args.fresh_cache:  # where a cold compile spends its time, per Dynamo/inductor phase
        print(torch._dynamo.utils.compile_times(repr="str"))


if __name__ == "__main__":
    main()
