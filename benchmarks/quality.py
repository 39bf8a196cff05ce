#!/usr/bin/env python3
"""Drafter quality end to end for the embedded target (SmolLM2-135M-Instruct), in one command:

    data (regen) -> prepare -> train -> evaluate (by replay) -> summary.json + summary.md

Data: the target answers the first user turn (`--regen-max-turns`, default 1) of the first `--regen-limit`
conversations (default 7,728) of the built-in ShareGPT training split itself, greedy, its own stop tokens, at
most 256 new tokens (`dflash-train regen`), into OUT/data/regen.jsonl. A later call reuses that file; a call
stopped mid-way continues it (about 6 minutes on one H100 for first turns; every turn, `--regen-max-turns 0`,
takes hours: benchmarks/README.md). `--data FILE` trains on FILE instead (any shape
`prepare` reads) and skips regen.

Reference: a published DFlash trainer's figure for this target, tau ~1.37 (greedy, 256 new tokens, a sample of
MT-Bench and held-out ShareGPT prompts, block verification), after 759 steps of 5 layers, block 16, 512 anchors,
gamma 7, lr 6e-4, batch 16 on 7,728 ShareGPT first turns answered by SmolLM2-135M-Instruct (greedy, 256 new
tokens; 7,337 usable). configs/smollm2-reference.yaml is that recipe on our keys. The default data here is of
the same kind (ShareGPT first turns, the target's own greedy answers), not the same rows: the first conversations
of our training split.

We evaluate every prompt of MT-Bench (80, two turns), HumanEval (164) and held-out ShareGPT (557), greedy, block
verification and DDTree (not applicable to a drafter that refuses it: Domino, DSpark's rnn head), and report tau
per dataset and pooled, accuracy per block position (training metrics) and wall times; with `--variant`s of any
architecture, per variant its drafts per block (DSpark's B slots draft B tokens, the others B - 1), tau, training
wall time, conditional acceptance per drafted slot and a confidence head's calibration (acceptance_by_slot.json). Held-out ShareGPT (`assets.iter_sharegpt_split("heldout")`) is disjoint from our training split
by position, not by text: ShareGPT repeats prompts ("continue", pasted texts), and another `--data` file may hold
any of them. Every eval prompt whose turn equals a training user turn (whitespace collapsed, case folded), or
shares its first `--overlap-prefix` normalised characters with one, is dropped and counted in the summary.

Every stage is resumable and skipped when done (`dflash_train.commands.pipeline`: the stages' state and times in
OUT/pipeline.json; a work directory holds one target's work), so the work can span several calls
(`--deadline-s`): regen is stopped and continues, training stops with a checkpoint (the STOP file) and
resumes, evaluation keeps what it finished. Exit code 3 = not finished yet: run the same command again; 1 = a
stage's child process failed (the message names it and ends with its log's end; the next call runs it again).

    PYTHONPATH=src python benchmarks/quality.py --out runs/quality                    # everything, defaults
    PYTHONPATH=src python benchmarks/quality.py --out runs/quality --data DATA.jsonl.gz   # your data, no regen
    # CPU smoke: ... --regen-limit 16 --regen-max-new-tokens 32 optim.max_steps=3 run.device=cpu \
    #     data.max_batch_size=4 objective.max_anchors=32 --limit 1 --max-new-tokens 16 --workers 2 --device cpu
    # The architectures side by side (Domino with its own recipe's gamma slot weights):
    #     ... objective.slot_weighting=acceptance optim.schedule=wsd --variant dflash2=drafter.architecture=dflash2 \
    #     --variant dspark=drafter.architecture=dspark,drafter.block_size=15 \
    #     --variant domino=drafter.architecture=domino,objective.slot_weighting=gamma

Everything stays in --out: summary.json, summary.md, acceptance_by_slot.json, driver.log, the stages' logs,
run/export (the drafter), variants/NAME/export.
Evaluate an exported drafter again, on CPU or GPU, without training:

    PYTHONPATH=src python benchmarks/quality.py --out runs/quality-eval --drafter runs/quality/run/export \
        --data runs/quality/data/regen.jsonl --eval mt-bench --limit 2 --max-new-tokens 64 --device cpu
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Optional

if str(Path(__file__).resolve().parent) not in sys.path:  # quality_bench, also when this file is loaded by its path
    sys.path.insert(0, str(Path(__file__).resolve().parent))

from quality_bench.children import ChildFailed
from quality_bench.driver import Driver
from quality_bench.inputs import missing_inputs
from quality_bench.settings import (
    DEFAULT_CONFIG, DEFAULT_EVAL, EXIT_UNFINISHED, REGEN_BATCH_SIZE, REGEN_BATCH_TOKENS, REGEN_ENGINES, REGEN_LIMIT,
    REGEN_MAX_NEW_TOKENS, REGEN_MAX_TURNS
)
from quality_bench.workers import corpus_main, parse_thresholds, replay_main, worker_main


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="\n\n".join(__doc__.split("\n\n")[:3]),  # what it does, the data
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("overrides", nargs="*", help="dotted config overrides for training, e.g. optim.max_steps=3")
    p.add_argument("--out", required=True,
                   help="work directory: data/ (the regenerated training set), prepared/, run/ (run/export: the "
                        "drafter), replay/, eval/, summary.json, summary.md, driver.log")
    p.add_argument("--config", default=str(DEFAULT_CONFIG), help="training recipe (default: %(default)s)")
    p.add_argument("--data", metavar="FILE",
                   help="train on this file of conversations (any shape `dflash-train prepare` reads) and skip "
                        "regen. Default: OUT/data/regen.jsonl, which the data stage writes: the target answers the "
                        "first --regen-limit conversations of the built-in ShareGPT training split")
    p.add_argument("--regen-limit", type=int, default=REGEN_LIMIT, metavar="N",
                   help="data stage: regenerate the first N conversations of the built-in ShareGPT training split "
                        "(it has 10,577) (default: %(default)s, the reference's data size)")
    p.add_argument("--regen-max-new-tokens", type=int, default=REGEN_MAX_NEW_TOKENS,
                   help="data stage: at most this many new tokens per assistant turn, greedy, ending at the "
                        "target's stop tokens (default: %(default)s)")
    p.add_argument("--regen-max-turns", type=int, default=REGEN_MAX_TURNS, metavar="N",
                   help="data stage: answer the first N user turns of each conversation, 0 = all (default: "
                        "%(default)s, first turns as the reference's data)")
    p.add_argument("--regen-batch-size", type=int, default=REGEN_BATCH_SIZE,
                   help="data stage: conversations per generate call at most, turn by turn (wider is faster); "
                        "may change between calls (default: %(default)s)")
    p.add_argument("--regen-batch-tokens", type=int, default=REGEN_BATCH_TOKENS, metavar="N",
                   help="data stage: padded tokens per generate call at most, rows x (longest prompt + max new "
                        "tokens), which its memory grows with (the longest prompts' batch of 256 rows took ~77 GB); "
                        "lower it after an out-of-memory error, 0 = no bound (default: %(default)s)")
    p.add_argument("--regen-engine", choices=REGEN_ENGINES, default="generate",
                   help="data stage: regen --engine (continuous: transformers' continuous batching, greedy) "
                        "(default: %(default)s)")
    p.add_argument("--val-fraction", type=float, default=0.0, help="prepare --val-fraction (0: train on every row)")
    p.add_argument("--eval", action="append", metavar="NAME[=FILE]",
                   help="eval set: mt-bench, humaneval, sharegpt (built-in) or NAME=prompts.jsonl; repeat. "
                        f"Default: {', '.join(DEFAULT_EVAL)}")
    p.add_argument("--limit", type=int, default=0, help="prompts per eval set after the overlap filter (0 = all)")
    p.add_argument("--overlap-prefix", type=int, default=200,
                   help="also drop eval prompts sharing this many leading normalised characters with a training "
                        "prompt (0: exact matches only)")
    p.add_argument("--max-new-tokens", type=int, default=256, help="eval: new tokens per turn (default: %(default)s)")
    p.add_argument("--tree-budget", type=int, action="append", default=None, help="DDTree budget(s) (default 32)")
    p.add_argument("--baseline", action="store_true",
                   help="also decode with the target alone (speedup and lossless check; ~1.5x the eval time)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="eval compute dtype (float32: greedy decoding is exactly the target's)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--eval-target-quantize", default="none", choices=["none", "fp8"],
                   help="fp8: evaluate every drafter on the target as it is served in FP8 (eval --target-quantize; "
                        "needs --dtype bfloat16); the trained runs are kept, only the evaluation is redone")
    p.add_argument("--workers", type=int, default=0, help="parallel eval processes (0: min(12, CPUs - 2) on GPU, 1 on CPU)")
    p.add_argument("--stages", default=None,
                   help="comma-separated subset of data,prepare,train,eval (default: all; data only without "
                        "--data; with --drafter: eval)")
    p.add_argument("--drafter", metavar="PATH",
                   help="evaluate this exported drafter folder (config.json + model.safetensors, e.g. "
                        "OUT/run/export of an earlier run) instead of training one: no data, no prepare, no train. "
                        "--data names the training file the eval prompts are filtered against (default: "
                        "OUT/data/regen.jsonl; missing: no filter, said in the summary); the target comes from "
                        "--config")
    p.add_argument("--deadline-s", type=float, default=0,
                   help="stop cleanly after this many seconds (regen and training continue where they stopped, "
                        "eval keeps finished prompts); "
                        "the same command continues. 0 = no deadline")
    p.add_argument("--train-stop-margin-s", type=float, default=45.0,
                   help="with --deadline-s: ask training to stop this long before the deadline")
    p.add_argument("--eval-stop-margin-s", type=float, default=40.0,
                   help="with --deadline-s: workers start no prompt this long before the deadline")
    p.add_argument("--method", default="replay", choices=["replay", "decode"],
                   help="replay (default): tau of greedy speculative decoding from the target's own greedy "
                        "continuations (exact, minutes for every prompt); decode: real step-by-step decoding")
    p.add_argument("--check-decode", type=int, default=0, metavar="N",
                   help="with --method replay: also decode the first N prompts of each set for real with every "
                        "trained drafter (the default's with the target alone too: speedup) and compare each with "
                        "its replay turn by turn")
    p.add_argument("--variant", action="append", metavar="NAME=K=V[,K=V...]",
                   help="also train this recipe (the overrides on top of the default's), at the same time (see "
                        "--one-at-a-time), and replay it; repeat. The default run keeps GPU 0 to itself when there "
                        "are several. onpolicy.start_from=@RUN (default or an earlier variant) makes it the on-policy "
                        "stage of that run: it trains once RUN has exported")
    p.add_argument("--one-at-a-time", action="store_true",
                   help="train the runs one after another (the default first, then the variants in order), each alone "
                        "on its GPU, instead of all at once: their training wall times compare (equal-GPU-time "
                        "comparisons, e.g. the on-policy stage against longer training)")
    p.add_argument("--confidence-thresholds", type=parse_thresholds, default=(), metavar="C[,C...]",
                   help="with --method replay: also report, per drafter with a confidence head, tau and tokens "
                        "verified per step of block decoding truncated at each threshold (eval "
                        "--confidence-threshold), e.g. 0.2,0.4")
    p.add_argument("--curve-every", type=int, default=0, metavar="STEPS",
                   help="save the default run every STEPS steps and replay every checkpoint: tau against training time")
    return p


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("worker", "corpus", "replay"):
        return {"worker": worker_main, "corpus": corpus_main, "replay": replay_main}[argv[0]](argv[1:])
    args = build_parser().parse_args(argv)
    args.tree_budget = args.tree_budget or [32]
    default = "eval" if args.drafter else "prepare,train,eval" if args.data else "data,prepare,train,eval"
    stages = {s.strip() for s in (args.stages or default).split(",") if s.strip()}
    unknown = stages - {"data", "prepare", "train", "eval"}
    if unknown:
        raise SystemExit(f"unknown stages {sorted(unknown)}")
    if "data" in stages and args.data:
        raise SystemExit(f"--data {args.data}: the training file is given, there is no data stage to run "
                         "(leave data out of --stages, or leave --data out to regenerate)")
    if min(args.regen_limit, args.regen_max_new_tokens, args.regen_batch_size) < 1:
        raise SystemExit("--regen-limit, --regen-max-new-tokens and --regen-batch-size must be positive")
    if args.regen_batch_tokens < 0:
        raise SystemExit("--regen-batch-tokens must be >= 0 (0 = no bound)")
    if args.regen_max_turns < 0:
        raise SystemExit("--regen-max-turns must be >= 0 (0 = every turn)")
    if args.confidence_thresholds and args.method != "replay":
        raise SystemExit("--confidence-thresholds is reported by replay: drop --method decode (or the thresholds)")
    if args.drafter:
        if stages != {"eval"}:
            raise SystemExit(f"--drafter evaluates a given drafter: stages {sorted(stages)} make no sense with it "
                             "(leave --stages out)")
        missing = [n for n in ("config.json", "model.safetensors") if not (Path(args.drafter) / n).is_file()]
        if missing:
            raise SystemExit(f"--drafter {args.drafter}: {', '.join(missing)} missing: not an exported drafter folder")
    eval_sets = (args.eval or list(DEFAULT_EVAL)) if "eval" in stages else []
    missing = missing_inputs(eval_sets, regen="data" in stages and not args.data)
    if missing:
        raise SystemExit("this machine lacks what the stages need:\n  " + "\n  ".join(missing))
    from dflash_train.commands.pipeline import RecipeMismatch

    try:
        drv = Driver(args)
    except RecipeMismatch as e:
        raise SystemExit(str(e)) from None
    try:
        return 0 if drv.runner.run(drv.stages(stages)).finished else EXIT_UNFINISHED
    except ChildFailed as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        drv.log(f"this call: {time.time() - drv.start:.0f} s; totals {drv.runner.times}")

if __name__ == "__main__":
    sys.exit(main())
