"""The cold compile of the training step on the CPU: the GPU benchmark's compiled functions (the target's
decoder layer without grad, the drafter's two layer graphs forward and backward, the CE chunk), each through
the compile layer with inductor, at a small hidden size, in one process with an empty compile cache.

    PYTHONPATH=src python benchmarks/cold_compile_cpu.py [--cold-compile-levers off] [--json out.jsonl]

Prints the first step's wall time (target warm-up + one training step) and Dynamo's per-phase timings
(`torch._dynamo.utils.compile_times`). Inductor's C++ code generation and its compiler builds stand in for
Triton's: compare the phases before code generation (Dynamo tracing, AOTAutograd, the FX passes, lowering,
scheduling). flex_attention is not compiled here (no CPU backward): the drafter attends with SDPA eagerly,
between its two compiled graphs, as on a CPU run.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import tempfile
import time

import torch


def _main_process_cpu_s() -> float:
    """CPU seconds of this process (all its threads; not its compiler subprocesses): the Python side of a
    compile, much less disturbed than wall time by other work on the machine."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _watch_aot_cache_bypasses() -> list[str]:
    """The reasons AOTAutograd gives for not caching a graph (its INFO records), collected into the list."""
    import logging

    reasons: list[str] = []

    class _Bypass(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            message = record.getMessage()
            if message.startswith("Bypassing autograd cache"):
                reasons.append(message.partition("due to: ")[2][:300])

    logger = logging.getLogger("torch._functorch._aot_autograd.autograd_cache")
    logger.setLevel(logging.INFO)
    logger.addHandler(_Bypass(level=logging.INFO))
    return reasons


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--anchors", type=int, default=8)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--cold-compile-levers", choices=("on", "off"), default=None,
                    help="DFLASH_TRAIN_COLD_COMPILE_LEVERS for this run (default: the environment's, else off)")
    ap.add_argument("--inductor-option", action="append", default=[],
                    help="key=value (python literal) added to every compile's inductor options (a lever on trial)")
    ap.add_argument("--json", default=None, help="append the result line to this file")
    ap.add_argument("--cache-dir", default=None,
                    help="reuse this compile cache (a second run: the warm start); default: a fresh empty one")
    args = ap.parse_args()
    if args.cold_compile_levers:
        os.environ["DFLASH_TRAIN_COLD_COMPILE_LEVERS"] = "1" if args.cold_compile_levers == "on" else "0"

    from throughput import add_inductor_options
    from transformers import AutoModelForCausalLM, Qwen3Config

    from dflash_train.architectures.drafter import default_target_layer_ids
    from dflash_train.architectures.family import loss as loss_mod
    from dflash_train.architectures.family.backend import resolve_backend
    from dflash_train.architectures.family.config import make_drafter_config
    from dflash_train.architectures.dflash.model import DFlashDrafter
    from dflash_train.config.load import config_from_dict
    from dflash_train.data.batch import Batch
    from dflash_train.accel import compile as compile_layer
    from dflash_train.target import capture as target_mod
    from dflash_train.train.loop.step import TrainStep

    add_inductor_options(args.inductor_option)
    target_mod._COMPILE_DEVICES = ("cuda", "cpu")  # the GPU's compiled functions, compiled for the CPU
    loss_mod.chunk_function = lambda name, fn, device, eager=None: compile_layer.compiled(name, fn, dynamic=True)

    bypasses = _watch_aot_cache_bypasses()
    process_t0 = time.perf_counter()
    cache = compile_layer.configure_cache(args.cache_dir or tempfile.mkdtemp(prefix="cold-cpu-"),
                                          fresh=not args.cache_dir)
    workers = compile_layer.start_compile_workers()
    h = args.hidden
    shape = dict(hidden_size=h, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=h // 4,
                 intermediate_size=3 * h, vocab_size=1000)
    tcfg = Qwen3Config(**shape, max_position_embeddings=4096)
    model = AutoModelForCausalLM.from_config(tcfg, dtype=torch.bfloat16).eval().requires_grad_(False)
    ids = default_target_layer_ids(shape["num_hidden_layers"], args.layers)
    target = target_mod.TargetCapture.from_model(model, ids, compile=True)
    dcfg = make_drafter_config(tcfg, num_draft_layers=args.layers, block_size=args.block, target_layer_ids=ids,
                               mask_token_id=5)
    drafter = DFlashDrafter(dcfg)
    drafter.compile_layers()
    cfg = config_from_dict({"drafter": {"block_size": args.block, "num_draft_layers": args.layers},
                            "objective": {"max_anchors": args.anchors},
                            "data": {"max_length": args.seq, "token_budget": args.seq * args.batch}})
    device = torch.device("cpu")
    step = TrainStep(drafter, target, resolve_backend("sdpa", device, args.block), cfg, 1000, torch.bfloat16, device)
    g = torch.Generator().manual_seed(0)
    input_ids = torch.randint(10, shape["vocab_size"], (args.batch, args.seq), generator=g)
    loss_mask = torch.ones_like(input_ids)
    loss_mask[:, : args.seq // 10] = 0
    batch = Batch(input_ids, loss_mask, torch.full((args.batch,), args.seq))
    compile_layer.begin_warm_up()

    t, cpu = time.perf_counter(), _main_process_cpu_s()
    target_warm = target.warm_up(args.seq, one_row=args.batch == 1, several_rows=args.batch > 1)
    t_target = time.perf_counter() - t
    step(batch, 0)
    first_step_s, first_step_cpu_s = time.perf_counter() - t, _main_process_cpu_s() - cpu
    graphs = compile_layer.graphs_compiled()
    step(batch, 1)
    result = {"cold_compile_levers": compile_layer.cold_compile_levers_on(),
              "inductor_options": compile_layer.inductor_options(), "torch": torch.__version__,
              "workers": workers, "first_step_s": round(first_step_s, 2),
              "first_step_main_process_cpu_s": round(first_step_cpu_s, 2), "target_warm_up_s": round(t_target, 2),
              "drafter_first_step_s": round(first_step_s - t_target, 2),
              "graphs_after_first_step": compile_layer.graphs_compiled() - graphs,
              "start_to_first_step_s": round(time.perf_counter() - process_t0, 2), "cache": str(cache),
              **compile_layer.cache_stats(), **compile_layer.compile_phase_totals(), **target_warm,
              "aot_cache_bypass_reasons": sorted(set(bypasses))}
    print(json.dumps(result))
    print(torch._dynamo.utils.compile_times(repr="str"))
    if args.json:
        phases = torch._dynamo.utils.compile_times(repr="csv")
        with open(args.json, "a") as f:
            f.write(json.dumps({**result, "phases": dict(zip(*phases))}, default=str) + "\n")


if __name__ == "__main__":
    main()
