"""The child processes' entry points: a decode worker (real speculative decoding of a shard), the replay corpus (the
target's greedy continuations) and the replay of one drafter over it."""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from .shards import record_key


@dataclass
class EvalSettings:
    max_new_tokens: int = 256
    temperature: float = 0.0
    tree_budgets: tuple = (32,)
    baseline: bool = False
    dtype: str = "float32"
    device: str = "auto"
    target_quantize: str = "none"  # fp8: decode with the target as it is served in FP8 (every decoder layer)

    def mode_names(self) -> list[str]:
        from dflash_train.infer.evaluate import make_modes

        return [m.name for m in make_modes(tuple(self.tree_budgets), self.baseline)]


@dataclass
class DecodeJob:
    """Prompts to decode for real with one drafter: its records, plan and report go to `eval_dir`."""

    drafter: Path
    items: list[dict]
    info: dict
    eval_dir: Path
    settings: EvalSettings


def run_shard(target, tokenizer, drafter, stops: list[int], items: list[dict], out: Path, settings: EvalSettings,
              deadline: Optional[float] = None, done: Optional[set] = None) -> int:
    """Decode `items` ({"dataset", "id", "turns"}) with every mode; append one record per prompt to `out`
    (flushed at once). Skips keys in `done`; stops before a prompt once `deadline` (epoch s) has passed.
    Returns the number of prompts decoded."""
    import torch

    from dflash_train.infer.evaluate import make_modes, run_prompt
    from dflash_train.infer.spec_decode import SpeculativeDecoder

    dec = SpeculativeDecoder(target, drafter, stops, settings.temperature)
    modes = make_modes(tuple(settings.tree_budgets), settings.baseline)
    n = 0
    with open(out, "a", encoding="utf-8") as f, torch.no_grad():
        for item in items:
            if done and record_key(item["dataset"], item["id"]) in done:
                continue
            if deadline is not None and time.time() > deadline:
                break
            t0 = time.time()
            rec = run_prompt(dec, tokenizer, item, modes, settings.max_new_tokens, None, item["dataset"])
            rec["wall_s"] = round(time.time() - t0, 3)
            f.write(json.dumps(rec) + "\n")
            f.flush()
            n += 1
    return n


def worker_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="quality.py worker")
    p.add_argument("--target", required=True)
    p.add_argument("--drafter", required=True)
    p.add_argument("--items", required=True, help="JSONL of {dataset, id, turns}")
    p.add_argument("--out", required=True)
    p.add_argument("--settings", required=True, help="EvalSettings as JSON")
    p.add_argument("--deadline", type=float, default=None)
    args = p.parse_args(argv)
    from dflash_train.infer.evaluate import load_eval_models
    from dflash_train.runtime import resolve_device, resolve_dtype

    settings = EvalSettings(**json.loads(args.settings))
    device = resolve_device(settings.device)
    target, tokenizer, drafter, stops = load_eval_models(args.target, args.drafter, device,
                                                         resolve_dtype(settings.dtype, device),
                                                         target_quantize=settings.target_quantize)
    items = [json.loads(line) for line in Path(args.items).read_text(encoding="utf-8").splitlines() if line.strip()]
    n = run_shard(target, tokenizer, drafter, stops, items, Path(args.out), settings, args.deadline)
    print(f"worker: {n} of {len(items)} prompts decoded", flush=True)
    return 0


# --------------------------------------------------------------------------- replay workers


def _load_target(path: str, settings: EvalSettings):
    """(target, tokenizer, stop ids, device) for replay, without a drafter."""
    from dflash_train import assets
    from dflash_train.infer.evaluate import load_eval_target
    from dflash_train.target.capture import load_tokenizer
    from dflash_train.assets import stop_token_ids
    from dflash_train.runtime import resolve_device, resolve_dtype

    device = resolve_device(settings.device)
    tpath = assets.resolve_target(path)
    tokenizer = load_tokenizer(tpath)
    stops = stop_token_ids(tpath, tokenizer)
    target = load_eval_target(tpath, resolve_dtype(settings.dtype, device), device, settings.target_quantize)
    return target, tokenizer, stops, device


def corpus_main(argv: list[str]) -> int:
    """Every eval turn with the target's greedy continuation, as JSONL (`ReplayTurn` fields)."""
    p = argparse.ArgumentParser(prog="quality.py corpus")
    p.add_argument("--target", required=True)
    p.add_argument("--items", required=True)
    p.add_argument("--block-size", type=int, required=True,
                   help="the widest step to be replayed: 1 + the most drafts of a block (continuations are "
                        "max_new_tokens + this - 1 tokens)")
    p.add_argument("--settings", required=True)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    from dataclasses import asdict

    from dflash_train.infer.replay import build_corpus
    from dflash_train.files.io import write_text_atomic

    settings = EvalSettings(**json.loads(args.settings))
    target, tokenizer, stops, _ = _load_target(args.target, settings)
    items = [json.loads(line) for line in Path(args.items).read_text(encoding="utf-8").splitlines() if line.strip()]
    t0 = time.time()
    corpus = build_corpus(target, tokenizer, items, settings.max_new_tokens, args.block_size, stops, args.batch_size)
    write_text_atomic(Path(args.out), "".join(json.dumps(asdict(t)) + "\n" for t in corpus))
    print(f"corpus: {len(corpus)} turns of {len(items)} prompts in {time.time() - t0:.1f} s", flush=True)
    return 0


def replay_main(argv: list[str]) -> int:
    """Tau by replay of the corpus for each `--drafter NAME=PATH`: each turn's record appended to
    `--partial NAME=FILE` as it is done (a call the deadline stopped resumes there), then the prompt records to
    OUT_DIR/NAME.jsonl."""
    p = argparse.ArgumentParser(prog="quality.py replay")
    p.add_argument("--target", required=True)
    p.add_argument("--corpus", required=True)
    p.add_argument("--drafter", action="append", required=True, metavar="NAME=PATH")
    p.add_argument("--partial", action="append", required=True, metavar="NAME=FILE")
    p.add_argument("--settings", required=True)
    p.add_argument("--out-dir", required=True)
    p.add_argument("--confidence-thresholds", type=parse_thresholds, default=(),
                   help="also replay block decoding truncated at each (drafters with a confidence head)")
    args = p.parse_args(argv)
    from dflash_train.infer.evaluate import check_pair
    from dflash_train.infer.replay import ReplayTurn, prompt_records, turn_records
    from dflash_train.architectures.io import load_drafter
    from dflash_train.files.io import write_text_atomic

    settings = EvalSettings(**json.loads(args.settings))
    target, tokenizer, stops, device = _load_target(args.target, settings)
    corpus = [ReplayTurn(**json.loads(line)) for line in Path(args.corpus).read_text(encoding="utf-8").splitlines()]
    partial = {name: Path(path) for name, _, path in (spec.partition("=") for spec in args.partial)}
    drafters, done = {}, {}
    for spec in args.drafter:
        name, _, path = spec.partition("=")
        drafters[name] = load_drafter(path, device=device, dtype=next(target.parameters()).dtype).eval()
        check_pair(target.config, drafters[name])
        drop_torn_tail(partial[name])
        done[name] = {(r["dataset"], r["id"], r["turn"]) for r in read_turn_records(partial[name])}
    resumed = sum(len(d) for d in done.values())
    t0 = time.time()
    files = {name: partial[name].open("a", encoding="utf-8") for name in drafters}
    try:
        for name, rec in turn_records(target, tokenizer, drafters, corpus, settings.max_new_tokens,
                                      settings.tree_budgets, stops,
                                      done=lambda n, t: (t.dataset, t.id, t.turn) in done[n],
                                      confidence_thresholds=args.confidence_thresholds):
            files[name].write(json.dumps(rec) + "\n")
            files[name].flush()
    finally:
        for f in files.values():
            f.close()
    for name in drafters:
        records = prompt_records(read_turn_records(partial[name]))
        write_text_atomic(Path(args.out_dir) / f"{name}.jsonl", "".join(json.dumps(r) + "\n" for r in records))
    print(f"replay: {len(drafters)} drafter(s) x {len(corpus)} turns in {time.time() - t0:.1f} s"
          + (f" ({resumed} turn records of an earlier call kept)" if resumed else ""), flush=True)
    return 0


def drop_torn_tail(path: Path) -> None:
    """Cut what follows the last newline (a line a stopped process left half-written), so that appending
    starts on a line of its own."""
    if path.is_file():
        data = path.read_bytes()
        if data and not data.endswith(b"\n"):
            path.write_bytes(data[:data.rfind(b"\n") + 1])


def read_turn_records(path: Path) -> list[dict]:
    """The complete lines of a partial replay file (a process stopped mid-write leaves at most one cut line)."""
    if not path.is_file():
        return []
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def parse_thresholds(text: str) -> tuple[float, ...]:
    """`0.2,0.4` -> (0.2, 0.4): confidence thresholds, each in (0, 1] (0 would truncate nothing)."""
    try:
        values = tuple(float(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: comma-separated numbers, e.g. 0.2,0.4") from None
    if not values or any(not 0 < c <= 1 for c in values):
        raise argparse.ArgumentTypeError(f"{text!r}: each threshold must be in (0, 1]")
    return tuple(dict.fromkeys(values))
