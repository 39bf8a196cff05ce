#!/usr/bin/env python3
"""What checkpoints cost a real training run: `dflash-train train` itself, the same run twice, once with a checkpoint
every `--save-every` steps and once without (only the final one), each in a fresh process with its own empty
compile cache, one after the other on one GPU (each run's checkpoints are deleted once read: the next run needs the disk).

    PYTHONPATH=src python benchmarks/checkpoint_run.py --work WORKDIR --data DATA.jsonl.gz --tokenizer TOKDIR \
        --random-target qwen3-8b --steps 300 --save-every 100 [OVERRIDES ...]
    PYTHONPATH=src python benchmarks/checkpoint_run.py --work WORKDIR --data DATA.jsonl.gz --target MODEL_DIR ...

`--random-target SHAPE` (a shape of throughput.py) writes a randomly initialised target of that shape once to
WORKDIR/target (bf16 safetensors, `--tokenizer`'s files beside them); `--target` uses a model folder instead. The
config is `--config` (configs/qwen3-8b.yaml) with `OVERRIDES`.

Prints one JSON line per run and a table last: the end-to-end wall time (process start to exit), the time from the
first step's record to the exit, the loop's stall of each save (`checkpoint_stall_s` of the metrics record after
it), the background write's seconds, the tokens/s of the window holding each save against the median of the
others, and the tail (the last record to the exit: the final checkpoint and the export).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "dflash_target.json")


def write_random_target(shape_name: str, tokenizer: Path, out: Path, device: str) -> Path:
    """A random target of `shape_name` with `tokenizer`'s files, written once (reused while its config exists)."""
    if (out / "config.json").is_file():
        return out
    import torch
    from transformers import AutoModelForCausalLM

    sys.path.insert(0, str(REPO / "benchmarks"))
    from throughput import SHAPES, target_config

    shape = dict(SHAPES[shape_name])
    from transformers import AutoTokenizer

    vocab = len(AutoTokenizer.from_pretrained(tokenizer))
    shape["vocab_size"] = max(shape["vocab_size"], vocab)  # every token id of the data must embed
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(target_config(shape), dtype=torch.bfloat16)
    model.save_pretrained(partial)
    del model
    for name in TOKENIZER_FILES:
        if (tokenizer / name).is_file():
            shutil.copy(tokenizer / name, partial / name)
    partial.rename(out)
    return out


def train_once(name: str, args: argparse.Namespace, target: Path, extra: list[str]) -> dict:
    run_dir = args.work / name
    shutil.rmtree(run_dir, ignore_errors=True)
    cache = args.work / f"compile-cache-{name}"  # each run compiles cold
    shutil.rmtree(cache, ignore_errors=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "dflash_train", "train", str(args.config), f"target.path={target}",
           f"data.train_files=[{args.data}]", "--run-dir", str(run_dir), "--max-steps", str(args.steps),
           f"run.log_every={args.log_every}", "run.progress_bar=false", f"run.compile_cache_dir={cache}", *extra,
           *args.overrides]
    t0 = time.time()
    with open(args.work / f"{name}.log", "w") as log:
        rc = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    t1 = time.time()
    if rc != 0:
        raise SystemExit(f"{name}: dflash-train train exited {rc}; see {args.work / f'{name}.log'}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "tokens_per_s" in r and "step" in r]
    saves = [r for r in steps if r.get("checkpoint_stall_s")]
    quiet = [r["tokens_per_s"] for r in steps[1:] if not r.get("checkpoint_stall_s")]
    median_quiet = statistics.median(quiet) if quiet else None
    checkpoints = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    shutil.rmtree(run_dir / "checkpoints")  # the next run needs the disk: a checkpoint of an 8B drafter is 12 GB
    shutil.rmtree(cache)
    return {
        "run": name,
        "steps": steps[-1]["step"],
        "wall_s": round(t1 - t0, 1),
        "first_record_to_exit_s": round(t1 - steps[0]["time"], 1),
        "tail_s": round(t1 - steps[-1]["time"], 1),
        "tokens_per_s_median": round(median_quiet) if median_quiet else None,
        "saves": [{"record_step": r["step"], "stall_s": r["checkpoint_stall_s"],
                   "window_tokens_per_s": round(r["tokens_per_s"])} for r in saves],
        # a write outlasts its window: its seconds arrive with the first record after it ends
        "write_s": [r["checkpoint_write_s"] for r in steps if r.get("checkpoint_write_s")],
        "mfu_median": statistics.median([r["mfu"] for r in steps[1:] if r.get("mfu") is not None] or [0]) or None,
        "recompiles_after_warmup": steps[-1].get("recompiles_after_warmup"),
        "checkpoints": checkpoints,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("overrides", nargs="*", help="dotted config overrides for both runs")
    ap.add_argument("--work", type=Path, required=True, help="work folder: the target, the runs, their logs")
    ap.add_argument("--data", type=Path, required=True)
    ap.add_argument("--config", type=Path, default=REPO / "configs" / "qwen3-8b.yaml")
    source = ap.add_mutually_exclusive_group(required=True)
    source.add_argument("--target", type=Path, help="a model folder")
    source.add_argument("--random-target", metavar="SHAPE", help="a shape of benchmarks/throughput.py")
    ap.add_argument("--tokenizer", type=Path, help="tokenizer folder for --random-target")
    ap.add_argument("--device", default="cuda", help="where the random target is initialised")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--save-every", type=int, default=100)
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--json", type=Path, help="append the runs' lines to this file")
    args = ap.parse_args()
    if args.random_target and not args.tokenizer:
        ap.error("--random-target needs --tokenizer")
    args.work.mkdir(parents=True, exist_ok=True)
    args.data = args.data.resolve()
    target = args.target
    if target is None:  # in a child process: this one keeps no GPU memory while the runs train
        target = args.work / "target"
        code = (f"import sys; sys.path.insert(0, {str(REPO / 'benchmarks')!r}); from checkpoint_run import "
                f"write_random_target as w; from pathlib import Path; w({args.random_target!r}, "
                f"Path({str(args.tokenizer)!r}), Path({str(target)!r}), {args.device!r})")
        subprocess.run([sys.executable, "-c", code], check=True)

    # Without saves: a save_every past the last step leaves only the final checkpoint.
    results = []
    for name, every in (("saves", args.save_every), ("no-saves", args.steps + 1)):
        r = train_once(name, args, target, [f"run.save_every={every}"])
        results.append(r)
        line = json.dumps(r)
        print(line, flush=True)
        if args.json:
            with open(args.json, "a") as f:
                f.write(line + "\n")
    print("| run | wall s | first record to exit s | tail s | tokens/s | save stalls s | save windows tokens/s "
          "| background writes s |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['run']} | {r['wall_s']} | {r['first_record_to_exit_s']} | {r['tail_s']} | "
              f"{r['tokens_per_s_median']} | {', '.join(str(s['stall_s']) for s in r['saves']) or '-'} | "
              f"{', '.join(str(s['window_tokens_per_s']) for s in r['saves']) or '-'} | "
              f"{', '.join(str(w) for w in r['write_s']) or '-'} |")
    saved, plain = results
    print(f"cost of {len(saved['saves'])} saves: {saved['wall_s'] - plain['wall_s']:+.1f} s end to end, "
          f"{saved['first_record_to_exit_s'] - plain['first_record_to_exit_s']:+.1f} s after the first record")


if __name__ == "__main__":
    main()
