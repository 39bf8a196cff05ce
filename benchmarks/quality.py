#!/usr/bin/env python3
"""Drafter quality end to end for the embedded target (SmolLM2-135M-Instruct), in one command:

    data (regen) -> prepare -> train -> evaluate (by replay) -> summary.json + summary.md

Data: the target answers the first user turn (`--regen-max-turns`, default 1) of the first `--regen-limit`
conversations (default 7,728) of the built-in ShareGPT training split itself, greedy, its own stop tokens, at
most 256 new tokens (`dflash-train regen`), into OUT/data/regen.jsonl. A later call reuses that file; a call
stopped mid-way continues it. It is the slow stage (about 16 minutes on one H200 for first turns; every turn,
`--regen-max-turns 0`, takes hours: benchmarks/README.md). `--data FILE` trains on FILE instead (any shape
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

Every stage is resumable and skipped when done (`dflash_train.pipeline`: the stages' state and times in
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
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Callable, Iterable, Optional

REPO = Path(__file__).resolve().parent.parent
if str(REPO / "src") not in sys.path:
    sys.path.insert(0, str(REPO / "src"))

REFERENCE = {
    "trainer": "a published DFlash trainer (its reported figure)",
    "data": "7,728 ShareGPT first turns answered by SmolLM2-135M-Instruct, greedy, 256 new tokens (7,337 usable)",
    "recipe": "5 layers, block 16, 512 anchors, gamma 7, lr 6e-4, batch 16, 759 steps (1.65 epochs)",
    "tau": 1.37,
    "tau_on": "MT-Bench + held-out ShareGPT (a small sample), greedy, 256 new tokens, block verification",
    "train_wall_s": 180,
}
DEFAULT_CONFIG = REPO / "configs" / "smollm2-reference.yaml"
# The data stage: the target answers the first REGEN_LIMIT conversations of the built-in ShareGPT training split
# (10,577 usable; 7,728 = the reference's data size), greedy, at most REGEN_MAX_NEW_TOKENS a turn.
REGEN_SOURCE = "sharegpt"
REGEN_LIMIT = 7728
REGEN_MAX_NEW_TOKENS = 256
REGEN_MAX_TURNS = 1  # first turns, as the reference's data: every turn (0) of 7,728 conversations takes hours
# Generation is host-bound (HF generate, ~10% of an H200 busy at 64): wider batches go faster; 256 conversations of
# the longest prompts took ~77 GB of an H200 at 256 new tokens a turn.
REGEN_BATCH_SIZE = 1024
REGEN_BATCH_TOKENS = 400_000  # padded tokens a generate call: ~60 GB for SmolLM2-135M on the H200
REGEN_FILE = Path("data") / "regen.jsonl"  # under --out
DEFAULT_EVAL = ("mt-bench", "humaneval", "sharegpt")
POOLED = ("mt-bench", "sharegpt")  # the reference's tau was measured on these two
EXIT_UNFINISHED = 3


# --------------------------------------------------------------------------- overlap with training data


def normalize(text: str) -> str:
    """Whitespace collapsed, case folded: the key two prompts are compared by."""
    return re.sub(r"\s+", " ", text).strip().casefold()


@dataclass
class OverlapIndex:
    """Normalised user turns of the training data (and their first `prefix_chars` characters)."""

    exact: set = field(default_factory=set)
    prefixes: set = field(default_factory=set)
    prefix_chars: int = 200

    @classmethod
    def from_texts(cls, texts: Iterable[str], prefix_chars: int = 200) -> "OverlapIndex":
        idx = cls(prefix_chars=prefix_chars)
        for text in texts:
            key = normalize(text)
            idx.exact.add(key)
            if prefix_chars > 0 and len(key) >= prefix_chars:
                idx.prefixes.add(key[:prefix_chars])
        return idx

    def match(self, text: str) -> Optional[str]:
        """"exact", "prefix" (same first prefix_chars characters) or None."""
        key = normalize(text)
        if key in self.exact:
            return "exact"
        if self.prefix_chars > 0 and len(key) >= self.prefix_chars and key[: self.prefix_chars] in self.prefixes:
            return "prefix"
        return None


def training_user_turns(paths: Iterable[str]) -> list[str]:
    """Every user turn of the training conversations (any shape `prepare` reads; bad rows skipped)."""
    from dflash_train.data.formats import RowError, iter_source, to_messages

    turns = []
    for path in paths:
        for _, row in iter_source(str(path)):
            try:
                messages = to_messages(row)
            except RowError:
                continue
            turns += [m["content"] for m in messages if m["role"] == "user"]
    return turns


def drop_overlap(items: list[dict], index: OverlapIndex) -> tuple[list[dict], list[dict]]:
    """(kept, dropped): an item is dropped when any of its turns is, or starts like, a training user turn.
    Each dropped entry is `{"id", "reason": "exact" | "prefix"}`."""
    kept, dropped = [], []
    for item in items:
        reasons = [r for r in (index.match(t) for t in item["turns"]) if r]
        if reasons:
            dropped.append({"id": item["id"], "reason": "exact" if "exact" in reasons else "prefix"})
        else:
            kept.append(item)
    return kept, dropped


# --------------------------------------------------------------------------- sharding


def plan_shards(items: list[dict], n: int) -> list[list[dict]]:
    """Split prompts over `n` workers: each item goes, in order, to the least-loaded shard (load = turns;
    ties: lowest index). Disjoint, complete, deterministic; empty shards are dropped."""
    if n < 1:
        raise ValueError(f"need at least one shard, got {n}")
    shards: list[list[dict]] = [[] for _ in range(n)]
    load = [0] * n
    for item in items:
        k = min(range(n), key=lambda i: (load[i], i))
        shards[k].append(item)
        load[k] += max(len(item["turns"]), 1)
    return [s for s in shards if s]


def record_key(dataset: str, item_id) -> str:
    return f"{dataset}\x00{item_id}"


def read_records(paths: Iterable[Path]) -> dict[str, dict]:
    """Prompt records from worker files, by (dataset, id); the first of duplicates wins; a torn last
    line (a worker killed mid-write) is ignored."""
    out: dict[str, dict] = {}
    for path in sorted(paths):
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            out.setdefault(record_key(rec["dataset"], rec["id"]), rec)
    return out


def merged_report(config: dict, items: list[dict], records: dict[str, dict], mode_names: list[str]) -> dict:
    """The report one process would have written for `items` (in their order), from worker records."""
    from dflash_train.infer.evaluate import report_from_records

    by_ds: dict[str, list[dict]] = {}
    order: dict[str, list] = {}
    for item in items:
        by_ds.setdefault(item["dataset"], [])
        order.setdefault(item["dataset"], []).append(item["id"])
        rec = records.get(record_key(item["dataset"], item["id"]))
        if rec is not None:
            by_ds[item["dataset"]].append(rec)
    return report_from_records(config, by_ds, {ds: mode_names for ds in by_ds}, order)


def drafter_origin(folder: Path, given: bool) -> dict:
    """Where an exported drafter came from, from its own files: path, weights' sha256, shape, the checkpoint
    it was exported from (README.md), its training recipe (training_config.yaml) and target (dflash_train.json)."""
    folder = Path(folder)
    out: dict = {"source": "given (--drafter)" if given else "trained by this run", "path": str(folder),
                 "model_sha256": _file_sha256(folder / "model.safetensors"),
                 "files": {p.name: p.stat().st_size for p in sorted(folder.iterdir()) if p.is_file()}}
    try:
        cfg = json.loads((folder / "config.json").read_text())
        out["config"] = {k: cfg.get(k) for k in ("num_hidden_layers", "block_size", "hidden_size", "dtype",
                                                 "num_target_layers")}
        out["config"]["target_layer_ids"] = (cfg.get("dflash_config") or {}).get("target_layer_ids")
    except (OSError, ValueError):
        pass
    readme = folder / "README.md"
    if readme.is_file():
        m = re.search(r"Exported by .*? from\s+`([^`]+)`", readme.read_text(errors="replace"), re.S)
        if m:
            out["exported_from"] = m.group(1)
    tc = folder / "training_config.yaml"
    if tc.is_file():
        try:
            import yaml

            t = yaml.safe_load(tc.read_text()) or {}
            out["training"] = {"target": (t.get("target") or {}).get("path"),
                               "train_files": (t.get("data") or {}).get("train_files"),
                               "max_steps": (t.get("optim") or {}).get("max_steps"),
                               "lr": (t.get("optim") or {}).get("lr"),
                               "drafter": t.get("drafter")}
        except Exception:  # a hand-edited file: its origin is still the path and hash above
            pass
    prov = folder / "dflash_train.json"
    if prov.is_file():
        try:
            p = json.loads(prov.read_text())
            out["trained_against"] = {k: p.get(k) for k in ("target", "tokenizer_sha256", "chat_template_sha256")}
        except ValueError:
            pass
    return out


# --------------------------------------------------------------------------- worker


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
    from dflash_train.runtime import write_text_atomic

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
    from dflash_train.algorithms.io import load_drafter
    from dflash_train.runtime import write_text_atomic

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


# --------------------------------------------------------------------------- replay summaries


def pooled_per_step(report: dict, modes: list[str], names: Optional[list[str]] = None,
                    field: str = "tau") -> dict[str, Optional[float]]:
    """A per-step mean (`field` of each dataset's mode: `tau`, `verified_per_step`) per mode over the steps of the
    named datasets (all when None) of a report; a dataset whose mode has no such value does not count."""
    out = {}
    for mode in modes:
        steps = total = 0.0
        for name, body in report["datasets"].items():
            s = body["modes"].get(mode)
            if (names is None or name in names) and s and s.get(field) is not None:
                steps += s["steps"]
                total += s[field] * s["steps"]
        out[mode] = total / steps if steps else None
    return out


def pooled_tau(report: dict, modes: list[str], names: Optional[list[str]] = None) -> dict[str, Optional[float]]:
    """Tau per mode over the steps of the named datasets (all when None) of a report."""
    return pooled_per_step(report, modes, names)


def pooled_verified(report: dict, modes: list[str], names: Optional[list[str]] = None) -> dict[str, Optional[float]]:
    """Tokens verified per step (`verified_per_step`) per mode over the steps of the named datasets (all when None)."""
    return pooled_per_step(report, modes, names, "verified_per_step")


def confidence_truncation(report: dict, truncated: dict, thresholds: tuple, drafts: int,
                          pooled_names: list[str]) -> dict:
    """One drafter's lines of the confidence truncation table: untruncated block decoding (every step verifies the
    anchor and all `drafts`: `report`, the drafter's replay report) and block decoding truncated at each threshold
    (`truncated`: its report of the `block-conf-C` modes), tau and tokens verified per step (`replay.verified_lengths`:
    the anchor and the drafts the target checks, eval's `verified_per_step`), pooled over MT-Bench + ShareGPT and all."""
    from dflash_train.infer.replay import confidence_mode

    rows = {"block": {"threshold": None, "tau_mt-bench+sharegpt": pooled_tau(report, ["block"], pooled_names)["block"],
                      "tau_all": pooled_tau(report, ["block"])["block"],
                      "verified_per_step_mt-bench+sharegpt": 1.0 + drafts, "verified_per_step_all": 1.0 + drafts}}
    for c in thresholds:
        mode = confidence_mode(c)
        rows[mode] = {"threshold": c, "tau_mt-bench+sharegpt": pooled_tau(truncated, [mode], pooled_names)[mode],
                      "tau_all": pooled_tau(truncated, [mode])[mode],
                      "verified_per_step_mt-bench+sharegpt": pooled_verified(truncated, [mode], pooled_names)[mode],
                      "verified_per_step_all": pooled_verified(truncated, [mode])[mode]}
    return {"drafts_per_block": drafts, "modes": rows}


def compare_with_decoding(decoded: dict[str, dict], replayed: dict[str, dict], modes: list[str]) -> dict:
    """Real decoding against replay, turn by turn, for the prompts decoded: how many turns have identical
    tokens and identical accept lengths, per mode, and the tau each way over those turns."""
    out = {}
    for mode in modes:
        turns = same_tokens = same_accepts = 0
        acc_dec: list[int] = []
        acc_rep: list[int] = []
        first_diff = []
        for key, drec in decoded.items():
            rrec = replayed.get(key)
            if rrec is None or mode not in drec["modes"]:
                continue
            for t, (d, r) in enumerate(zip(drec["modes"][mode], rrec["modes"][mode])):
                turns += 1
                same_tokens += d["token_ids"] == r["token_ids"]
                same_accepts += d["accept_lengths"] == r["accept_lengths"]
                if d["accept_lengths"] != r["accept_lengths"] and len(first_diff) < 5:
                    first_diff.append({"prompt": key.replace("\x00", "/"), "turn": t})
                acc_dec += d["accept_lengths"]
                acc_rep += r["accept_lengths"]
        out[mode] = {"turns": turns, "identical_tokens": same_tokens, "identical_accept_lengths": same_accepts,
                     "tau_decoded": sum(acc_dec) / len(acc_dec) if acc_dec else None,
                     "tau_replayed": sum(acc_rep) / len(acc_rep) if acc_rep else None, "differing": first_diff}
    return out


def metric_times(run: Path) -> dict[int, float]:
    """Step -> seconds of training after the first logged step (metrics `time` stamps)."""
    from dflash_train.run.metrics import read_metrics

    if not (run / "metrics.jsonl").is_file():
        return {}
    recs = [r for r in read_metrics(run) if r.get("kind") != "validation" and "time" in r]
    if not recs:
        return {}
    t0 = recs[0]["time"]
    return {r["step"]: r["time"] - t0 for r in recs}


# --------------------------------------------------------------------------- child processes


class ChildFailed(RuntimeError):
    """A stage's child process (regen, a helper, a training, an eval worker) failed; the message names it, its
    exit code and its log's end. The call ends with that message alone (exit 1); the next call runs the stage
    again."""



def child_env(**extra: str) -> dict:
    """This process's environment for a child: unbuffered, with src/ first on PYTHONPATH, plus `extra`."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src")] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.update(extra)
    return env


def visible_gpus(device: str) -> int:
    """GPUs the children may spread over (0 with --device cpu or without CUDA)."""
    import torch

    return torch.cuda.device_count() if device != "cpu" and torch.cuda.is_available() else 0


def gpu_env(env: dict, k: int, gpus: int) -> dict:
    """The k-th child's environment: on GPU k mod `gpus` when there are several (one process per GPU
    context would time-slice)."""
    return dict(env, CUDA_VISIBLE_DEVICES=str(k % gpus)) if gpus > 1 else env


@dataclass
class Child:
    name: str
    proc: subprocess.Popen
    log: IO[bytes]
    log_path: Path

    def tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:] if self.log_path.is_file() else ""


class Children:
    """Processes started together, each writing to its own log file. Leaving the `with` kills any still
    running and closes every log."""

    def __init__(self) -> None:
        self.procs: list[Child] = []

    def start(self, name: str, cmd: list[str], log_path: Path, env: dict, append: bool = False) -> Child:
        log = open(log_path, "ab" if append else "wb")
        child = Child(name, subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO), log, log_path)
        self.procs.append(child)
        return child

    def wait(self, poll_s: float, tick: Callable[[], None]) -> None:
        """Until every process has ended, calling `tick` after each `poll_s` of sleep."""
        while any(c.proc.poll() is None for c in self.procs):
            time.sleep(poll_s)
            tick()

    def __enter__(self) -> "Children":
        return self

    def __exit__(self, *exc) -> None:
        for c in self.procs:
            if c.proc.poll() is None:
                c.proc.kill()
                c.proc.wait()
            c.log.close()


def run_helpers(cmds: list[list[str]], folder: Path, what: str, runner, device: str, log: Callable[[str], None]) -> None:
    """Run these processes at once, one per GPU; raise with a log tail if one fails; Unfinished if the
    deadline passes."""
    from dflash_train.pipeline import Unfinished

    env = child_env(TOKENIZERS_PARALLELISM="false")
    gpus = visible_gpus(device)

    def tick() -> None:
        if runner.remaining() < 0:
            raise Unfinished(f"{what}: the deadline passed; run the same command again")

    with Children() as kids:
        for k, cmd in enumerate(cmds):
            kids.start(f"{what}-{k:02d}", cmd, folder / f"{what}-{k:02d}.log", gpu_env(env, k, gpus))
        kids.wait(1.0, tick)
    for c in kids.procs:
        if c.proc.returncode != 0:
            raise ChildFailed(f"{what} failed (exit {c.proc.returncode}); {c.log_path} ends:\n{c.tail()}")
        log(c.log_path.read_text(errors="replace").strip().splitlines()[-1])


def run_eval_workers(cmds: list[tuple[list[str], Path]], env: dict, runner, device: str,
                     log: Callable[[str], None], announce: str) -> tuple[list[int], bool, float]:
    """Run the eval workers (command, log file) at once, spread over the GPUs. Once the deadline has passed
    they are stopped (SIGTERM, a kill after 20 s; the prompts they finished are kept). Returns (exit codes,
    whether they were stopped, seconds from their start)."""
    gpus = visible_gpus(device)
    stopped = False

    def tick() -> None:
        nonlocal stopped
        if runner.remaining() >= 0 or stopped:
            return
        log("eval: hard deadline passed: stopping workers (finished prompts are kept)")
        stopped = True
        running = [c.proc for c in kids.procs if c.proc.poll() is None]
        for p in running:
            p.send_signal(signal.SIGTERM)
        for p in running:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()

    with Children() as kids:
        for k, (cmd, log_path) in enumerate(cmds):
            kids.start(f"worker-{k:02d}", cmd, log_path, gpu_env(env, k, gpus))
        log(announce)
        t0 = time.time()
        kids.wait(2.0, tick)
    return [c.proc.returncode for c in kids.procs], stopped, time.time() - t0


def run_regen(cmd: list[str], log_path: Path, runner, device: str, log: Callable[[str], None]) -> None:
    """Run `dflash-train regen` (`cmd`) as a child process on one GPU, its output appended to `log_path`; its
    summary goes to `log`. Once the deadline passes it is killed and the stage is Unfinished: regen appends each
    finished batch at once, so the same command continues where it stopped."""
    from dflash_train.pipeline import Unfinished

    def tick() -> None:
        if runner.remaining() < 0:
            raise Unfinished("the deadline passed during regen; run the same command again (it continues)")

    with Children() as kids:
        start = log_path.stat().st_size if log_path.is_file() else 0
        child = kids.start("regen", cmd, log_path, gpu_env(child_env(TOKENIZERS_PARALLELISM="false"), 0,
                                                            visible_gpus(device)), append=True)
        kids.wait(1.0, tick)
    if child.proc.returncode != 0:
        raise ChildFailed(f"regen failed (exit {child.proc.returncode}); {log_path} ends:\n{child.tail()}")
    with open(log_path, "rb") as f:  # this call's output: the summary regen printed last
        f.seek(start)
        lines = f.read().decode(errors="replace").splitlines()
    first = max((i for i, line in enumerate(lines) if line.startswith("regen: ")), default=len(lines))
    for line in lines[first:]:
        log(line)


def count_lines(path: Path) -> int:
    """Lines of a file (0 when it does not exist)."""
    if not path.is_file():
        return 0
    with open(path, "rb") as f:
        return sum(1 for _ in f)


@dataclass
class TrainJob:
    name: str
    run: Path
    cmd: list[str]
    log_path: Path
    env: dict


def run_trainings(jobs: list[TrainJob], runner, stop_margin_s: float, log: Callable[[str], None]) -> dict[str, tuple[int, float]]:
    """Run the training jobs at once. Once the deadline is `stop_margin_s` away, ask each to checkpoint and
    stop (its STOP file; the next call resumes it). Returns each job's (exit code, seconds it ran)."""
    t0 = time.time()
    ended: dict[str, float] = {}
    stopping = False

    def tick() -> None:
        nonlocal stopping
        for c in kids.procs:
            if c.proc.poll() is not None and c.name not in ended:
                ended[c.name] = time.time()
        if not stopping and runner.remaining() < stop_margin_s:
            log("train: deadline near: asking the runs to checkpoint and stop (they resume next call)")
            for job in jobs:
                job.run.mkdir(parents=True, exist_ok=True)
                (job.run / "STOP").touch()
            stopping = True

    with Children() as kids:
        for job in jobs:
            (job.run / "STOP").unlink(missing_ok=True)  # left by an earlier call's deadline: it would end this run at once
            log(f"train {job.name}: " + " ".join(job.cmd))
            kids.start(job.name, job.cmd, job.log_path, job.env, append=True)
        kids.wait(1.0, tick)
    for job in jobs:
        (job.run / "STOP").unlink(missing_ok=True)
    return {c.name: (c.proc.returncode, ended.get(c.name, time.time()) - t0) for c in kids.procs}


# --------------------------------------------------------------------------- the stages' inputs


def prepare_training_data(cfg, data: str, val_fraction: float, prepared: Path, log: Callable[[str], None]) -> Optional[float]:
    """`prepared` from the training file, unless it holds that file prepared with the same settings already.
    Returns the seconds spent preparing (None: reused)."""
    from dflash_train import assets
    from dflash_train.data.prepare import PrepareConfig, prepare, summary
    from dflash_train.data.store import has_label_counts
    from dflash_train.target.capture import load_tokenizer

    data = str(Path(data).resolve())
    want = {"max_length": cfg.data.max_length, "block_size": cfg.drafter.block_size, "val_fraction": val_fraction}
    manifest_path = prepared / "manifest.json"
    if manifest_path.is_file():
        m = json.loads(manifest_path.read_text())
        have = {k: m[k] for k in want}
        same_file = [s["data"] for s in m["sources"]] == [data] and _same_bytes(m["sources"][0])
        if have == want and same_file and has_label_counts(m):
            log(f"prepare: reusing {prepared} ({m['counts']['kept']} rows)")
            return None
        why = "" if has_label_counts(m) else " without label counts (drafter.draft_vocab_size)"
        if [s["data"] for s in m["sources"]] == [data] and not same_file:
            why += " (the file has changed since)"
        log(f"prepare: {prepared} was made with {have} from {[s['data'] for s in m['sources']]}{why}; redoing")
    t0 = time.time()
    target = assets.resolve_target(cfg.target.path)
    manifest = prepare(load_tokenizer(target), cfg.target.path, [data], prepared, PrepareConfig(overwrite=True, **want))
    seconds = time.time() - t0
    log(summary(manifest, prepared))
    return seconds


def _same_bytes(source: dict) -> bool:
    """Whether the files a prepared source entry lists are still what was prepared (size, then sha256): a
    regenerated file grows when an earlier, smaller regen is continued."""
    from dflash_train.data.store import file_sha256

    for f in source.get("files") or []:
        path = Path(f["path"])
        if not path.is_file() or path.stat().st_size != f.get("size") or file_sha256(path) != f.get("sha256"):
            return False
    return bool(source.get("files"))


def load_eval_items(specs: list[str], data: str, limit: int, overlap_prefix: int,
                    log: Callable[[str], None]) -> tuple[list[dict], dict, Optional[str]]:
    """All eval prompts in report order (overlap with the training file `data` removed), the drop counts per
    set, and the training file they were filtered against (None: `data` is missing, no filter)."""
    from dflash_train.infer.evaluate import iter_prompts

    if Path(data).is_file():
        overlap_data = data
        index = OverlapIndex.from_texts(training_user_turns([data]), overlap_prefix)
    else:  # only with --drafter: without --drafter, prepare has already failed on a missing file
        overlap_data = None
        index = OverlapIndex(prefix_chars=overlap_prefix)
        log(f"eval: training data {data} not found: eval prompts are NOT filtered against "
            "training prompts (pass --data with the drafter's training file)")
    items, info = [], {}
    for spec in specs:
        name, _, source = spec.partition("=")
        raw = [{"dataset": name, "id": it["id"], "turns": list(it["turns"])} for it in iter_prompts(source or name, 0)]
        kept, dropped = drop_overlap(raw, index)
        if limit:
            kept = kept[:limit]
        info[name] = {"source": source or f"built-in {name}", "prompts_total": len(raw), "prompts": len(kept),
                      "turns": sum(len(i["turns"]) for i in kept),
                      "dropped_overlap": {"exact": sum(d["reason"] == "exact" for d in dropped),
                                          "prefix": sum(d["reason"] == "prefix" for d in dropped)},
                      "dropped_ids": [d["id"] for d in dropped]}
        log(f"eval data {name}: {len(raw)} prompts, {len(dropped)} dropped as training prompts "
            f"({info[name]['dropped_overlap']}), {len(kept)} evaluated")
        items += kept
    return items, info, overlap_data


# --------------------------------------------------------------------------- the driver


def parse_variants(specs: list[str], config: str, overrides: list[str]) -> dict[str, list[str]]:
    """--variant NAME=K=V[,K=V...] -> {NAME: [K=V, ...]}; a bad spec or a variant whose config does not
    load fails now, before anything runs."""
    from dflash_train.config.load import load_config

    variants: dict[str, list[str]] = {}
    for spec in specs:
        name, sep, extra = spec.partition("=")
        if not sep or not re.fullmatch(r"[A-Za-z0-9_.-]+", name) or name == "default" or name in variants:
            raise SystemExit(f"--variant {spec!r}: expected NAME=key=value[,key=value...] with a new NAME of "
                             "letters, digits, _ . - (not 'default')")
        variants[name] = [o for o in extra.split(",") if o]
        load_config(config, list(overrides) + variants[name])
    return variants


def flex_refusals(configs: dict) -> list[str]:
    """The runs (name -> loaded config) whose training on a GPU would stop at its start: flex attention (the GPU's
    `drafter.attention_backend: auto`) tiles whole blocks into 128-query tiles, so it needs a block size dividing
    128 (`dflash.attention.resolve_backend`). Named before anything runs, with the fix."""
    from dflash_train.algorithms.dflash.attention import FLEX_TILE

    return [f"{name}: drafter.block_size={c.drafter.block_size} does not divide {FLEX_TILE}, which flex attention "
            f"(drafter.attention_backend={c.drafter.attention_backend}, flex on a GPU) needs; choose a block size "
            f"that divides it or add drafter.attention_backend=sdpa (dense masks: slower, more memory)"
            for name, c in configs.items()
            if c.run.device != "cpu" and c.drafter.attention_backend in ("auto", "flex") and FLEX_TILE % c.drafter.block_size]


def exported(folder: Path) -> bool:
    return (folder / "model.safetensors").is_file()


class Driver:
    """One call of the comparison: its stages (prepare, train, eval) run through a `StageRunner` on --out
    (state and times in pipeline.json), under the --deadline-s budget."""

    def __init__(self, args: argparse.Namespace):
        from dflash_train.config.load import load_config
        from dflash_train.pipeline import StageRunner

        self.args = args
        self.out = Path(args.out).resolve()
        self.out.mkdir(parents=True, exist_ok=True)
        # no --data: the data stage regenerates the training set into OUT/data (with --drafter: the eval prompts are
        # filtered against that file when an earlier run left it there)
        self.regen = not args.data
        args.tree_budget = args.tree_budget or [32]
        args.data = str(Path(args.data).resolve()) if args.data else str(self.out / REGEN_FILE)
        self.prepared = self.out / "prepared"
        self.run = self.out / "run"
        self.eval_dir = self.out / "eval"
        self.cfg = load_config(args.config, args.overrides)
        self.variants = parse_variants(getattr(args, "variant", None) or [], args.config, args.overrides)
        if visible_gpus(args.device) and not getattr(args, "drafter", None):
            refused = flex_refusals({name: load_config(args.config, overrides)
                                     for name, (_, overrides) in self.runs().items()})
            if refused:
                raise SystemExit("these runs would stop at the start of training on the GPU:\n  " + "\n  ".join(refused))
        self.start = time.time()
        self.log_file = open(self.out / "driver.log", "a", encoding="utf-8")
        # One target per work directory: its prepared tokens, drafters and continuations are that target's.
        self.runner = StageRunner(self.out, {"target": self.cfg.target.path}, label="quality comparison",
                                  remedy="remove it or pass another --out", adopt_unstamped=True,
                                  deadline=self.start + args.deadline_s if args.deadline_s else None, say=self.log)
        self.settings = EvalSettings(max_new_tokens=args.max_new_tokens, tree_budgets=tuple(args.tree_budget),
                                     baseline=args.baseline, dtype=args.dtype, device=args.device,
                                     target_quantize=args.eval_target_quantize)
        # --drafter: evaluate that exported drafter (no prepare, no train); else this run's export
        self.given_drafter = Path(args.drafter).resolve() if getattr(args, "drafter", None) else None
        self.drafter_dir = self.given_drafter or self.run / "export"
        self.overlap_data: Optional[str] = None  # the training file the eval prompts were filtered against
        self.failed: dict[str, str] = {}  # variants whose training failed this call: left out of the comparison

    def log(self, msg: str) -> None:
        line = f"[quality {time.strftime('%H:%M:%S')}] {msg}"
        print(line, flush=True)
        self.log_file.write(line + "\n")
        self.log_file.flush()

    def stages(self, names: set[str]) -> list:
        """The selected stages, in order. A done stage is skipped while its key (what it depends on) is unchanged."""
        from dflash_train.pipeline import Stage

        data_key = {"source": REGEN_SOURCE, "limit": self.args.regen_limit,
                    "max_new_tokens": self.args.regen_max_new_tokens, "max_turns": self.args.regen_max_turns}
        prepare_key = {"data": self.args.data, "max_length": self.cfg.data.max_length,
                       "block_size": self.cfg.drafter.block_size, "val_fraction": self.args.val_fraction}
        if self.needs_label_counts():  # only then: an older work directory's stages stay done otherwise
            prepare_key["label_counts"] = True
        all_stages = [
            Stage("data", self.stage_data, outputs=(Path(self.args.data),), key=data_key),
            Stage("prepare", self.stage_prepare, outputs=(self.prepared / "manifest.json",), key=prepare_key),
            Stage("train", self.stage_train, outputs=tuple(run / "export" / "model.safetensors"
                                                           for run, _ in self.runs().values()),
                  key={name: [str(run), overrides] for name, (run, overrides) in self.runs().items()}),
            Stage("eval", self.stage_eval, outputs=(self.out / "summary.json", self.out / "summary.md"),
                  key=self.eval_key, reuse=self.print_summary, min_remaining_s=self.args.eval_stop_margin_s + 60),
        ]
        return [s for s in all_stages if s.name in names and (s.name != "data" or self.regen)]

    def needs_label_counts(self) -> bool:
        """Whether a run trains a reduced draft vocabulary (`drafter.draft_vocab_size`), chosen from the prepared
        data's label counts (a directory prepared before they existed has none)."""
        from dflash_train.config.load import load_config

        return any(load_config(self.args.config, overrides).drafter.draft_vocab_size
                   for _, overrides in self.runs().values())

    def eval_key(self) -> dict:
        """Everything the summary depends on besides the stages before it: the arguments, the drafter's weights."""
        a = vars(self.args)
        key = {k: a[k] for k in ("config", "overrides", "data", "val_fraction", "eval", "limit", "overlap_prefix",
                                 "max_new_tokens", "tree_budget", "baseline", "dtype", "device", "workers", "method",
                                 "check_decode", "drafter", "variant", "curve_every", "eval_target_quantize")}
        if a.get("confidence_thresholds"):  # only when given: an eval done without them stays done
            key["confidence_thresholds"] = list(a["confidence_thresholds"])
        weights = self.drafter_dir / "model.safetensors"
        key["drafter_sha256"] = _file_sha256(weights) if weights.is_file() else None
        return key

    # ------------------------------------------------------------------ data

    def regen_command(self) -> list[str]:
        a = self.args
        return [sys.executable, "-m", "dflash_train", "regen", "--target", self.cfg.target.path,
                "--data", REGEN_SOURCE, "--limit", str(a.regen_limit), "--max-new-tokens", str(a.regen_max_new_tokens),
                "--max-turns", str(a.regen_max_turns), "--batch-size", str(a.regen_batch_size),
                "--batch-tokens", str(a.regen_batch_tokens), "--engine", a.regen_engine, "--device", a.device,
                "--no-progress", "--out", a.data]

    def stage_data(self) -> None:
        """The training set: the target's own greedy answers to the first --regen-limit conversations of the
        built-in ShareGPT training split (`dflash-train regen`, resumable: a call the deadline stopped, or an
        earlier run with a smaller limit, is continued)."""
        from dflash_train.data.regen.journal import side_paths

        out = Path(self.args.data)
        out.parent.mkdir(parents=True, exist_ok=True)
        cmd = self.regen_command()
        self.log("data: " + " ".join(cmd))
        t0 = time.time()
        try:
            run_regen(cmd, out.parent / "regen.log", self.runner, self.args.device, self.log)
        finally:
            self.runner.add_time("regen_s", time.time() - t0)
        rows, rejects = count_lines(out), count_lines(side_paths(out)[1])
        self.log(f"data: {out}: {rows} conversations, {rejects} rejected")

    def regen_summary(self) -> dict:
        """What the data stage made: its source and settings, conversations written and rejected."""
        from dflash_train.data.regen.journal import side_paths

        out = Path(self.args.data)
        return {"source": f"built-in {REGEN_SOURCE} (training split), the first {self.args.regen_limit} conversations",
                "generated_by": "the target, greedy, its stop tokens", "max_new_tokens": self.args.regen_max_new_tokens,
                "max_turns": self.args.regen_max_turns,
                "command": " ".join(["dflash-train"] + self.regen_command()[3:]),
                "conversations": count_lines(out), "rejected": count_lines(side_paths(out)[1])}

    # ------------------------------------------------------------------ prepare

    def stage_prepare(self) -> None:
        seconds = prepare_training_data(self.cfg, self.args.data, self.args.val_fraction, self.prepared, self.log)
        if seconds is not None:
            self.runner.add_time("prepare_s", seconds)

    # ------------------------------------------------------------------ train

    def runs(self) -> dict[str, tuple[Path, list[str]]]:
        """Training runs by name: "default" (the config and its overrides; with --curve-every it saves every
        that many steps) in run/, and each --variant in variants/NAME/ (the default's overrides, then its own)."""
        base = list(self.args.overrides)
        if self.args.curve_every:
            base += [f"run.save_every={self.args.curve_every}", "run.keep_last=1000"]
        runs = {"default": (self.run, base)}
        for name, extra in self.variants.items():
            runs[name] = (self.out / "variants" / name, list(self.args.overrides) + extra)
        return runs

    @staticmethod
    def train_gpu(name: str, k: int, gpus: int) -> int:
        """The default run has GPU 0 to itself (its wall time is the one compared with the reference); the
        variants share the others."""
        if name == "default" or gpus < 2:
            return 0
        return 1 + (k - 1) % (gpus - 1)

    def train_command(self, run: Path, overrides: list[str]) -> list[str]:
        from dflash_train.layout import list_checkpoints

        cmd = [sys.executable, "-m", "dflash_train", "train", str(self.args.config), *overrides,
               f"data.train_files=[{self.prepared}]", "--run-dir", str(run)]
        if run.joinpath("checkpoints").is_dir() and list_checkpoints(run / "checkpoints"):
            cmd.append("--resume")
        elif run.is_dir():
            cmd.append("--overwrite")  # an earlier call's attempt that never checkpointed: moved aside
        return cmd

    def stage_train(self) -> None:
        """Train every run not yet exported, at the same time (spread over the GPUs). Unfinished when the
        deadline stopped them (with a checkpoint: the next call resumes)."""
        from dflash_train.pipeline import Unfinished

        runs = self.runs()
        todo = {n: r for n, r in runs.items() if not exported(r[0] / "export")}
        for name in sorted(set(runs) - set(todo)):
            self.log(f"train {name}: reusing {runs[name][0] / 'export'}")
        if not todo:
            return
        gpus = visible_gpus(self.args.device)
        jobs = [TrainJob(name, run, self.train_command(run, overrides),
                         self.out / ("train.stdout.log" if name == "default" else f"train-{name}.stdout.log"),
                         gpu_env(child_env(), self.train_gpu(name, k, gpus), gpus))
                for k, (name, (run, overrides)) in enumerate(todo.items())]
        ends = run_trainings(jobs, self.runner, self.args.train_stop_margin_s, self.log)
        for name, (_, seconds) in ends.items():  # wall time of each training process (its share of this call)
            self.runner.add_time("train_s" if name == "default" else f"train_s:{name}", seconds)
        for job in jobs:
            self.check_training(job, ends[job.name][0])
        if not all(exported(r[0] / "export") for n, r in runs.items() if n not in self.failed):
            raise Unfinished("training stopped at the deadline with a checkpoint; run the same command again to "
                             "continue")

    def check_training(self, job: TrainJob, code: int) -> None:
        """A run's exit: done or stopped at the deadline (3) are fine; the default's failure ends the call, a
        variant's is reported and leaves it out of the comparison."""
        if code in (0, 3):  # done, or stopped at the deadline (resumes next call)
            return
        if job.name == "default":
            raise ChildFailed(f"training failed (exit {code}); see {job.log_path} and {job.run / 'train.log'}")
        text = job.log_path.read_text(errors="replace") if job.log_path.is_file() else ""
        tail = text.strip().splitlines()[-1:]
        self.log(f"train {job.name}: FAILED (exit {code}): {' '.join(tail)}; see {job.log_path}")
        self.failed[job.name] = f"exit {code}: {' '.join(tail)}"

    # ------------------------------------------------------------------ eval

    def stage_eval(self) -> dict:
        """Tau of the drafter(s) on every eval prompt, then summary.json and summary.md (printed). Unfinished
        while prompts are left (the deadline)."""
        from dflash_train.pipeline import Unfinished

        items, info = self.eval_items()
        if self.args.method == "decode":
            complete, info = self.decode(items, info)
            summary = self.summarize(complete, info)
        else:
            complete, info, extra = self.eval_by_replay(items, info)
            summary = self.summarize(complete, info, extra)
        print(summary_markdown(summary), flush=True)
        if not complete:
            raise Unfinished("prompts are left to decode; run the same command again")
        return summary

    def print_summary(self) -> dict:
        """An eval done in an earlier call: its summary, printed again."""
        print((self.out / "summary.md").read_text(), flush=True)
        return json.loads((self.out / "summary.json").read_text())

    def eval_items(self) -> tuple[list[dict], dict]:
        items, info, self.overlap_data = load_eval_items(self.args.eval or list(DEFAULT_EVAL), self.args.data,
                                                         self.args.limit, self.args.overlap_prefix, self.log)
        return items, info

    def workers(self) -> int:
        if self.args.workers:
            return self.args.workers
        cpus = os.cpu_count() or 2
        return max(1, min(12, cpus - 2)) if visible_gpus(self.args.device) else 1

    def settings_for(self, drafter: Path, **changes) -> "EvalSettings":
        """This call's eval settings for `drafter`, with `changes`: without DDTree budgets for a drafter that refuses
        DDTree (its tree modes are not applicable, `drafter_facts`)."""
        settings = EvalSettings(**{**self.settings.__dict__, **changes})
        if drafter_facts(drafter)["tree"] is not None:
            settings.tree_budgets = ()
        return settings

    def decode(self, items: list[dict], info: dict) -> tuple[bool, dict]:
        """Real decoding of `items` with the drafter under test by worker processes: (complete, eval info)."""
        job = DecodeJob(self.drafter_dir, items, info, self.eval_dir, self.settings_for(self.drafter_dir))
        return self.decode_jobs({"default": job})["default"]

    def decode_jobs(self, jobs: dict[str, "DecodeJob"]) -> dict[str, tuple[bool, dict]]:
        """Real decoding of each job's prompts with its drafter, the worker processes of every job at once (the
        --workers shared between the jobs by their prompts left, at least one each): per job (complete, eval
        info). Records of an earlier call with the same prompts, settings and drafter are kept; other ones are
        moved aside."""
        todo = {name: self.decode_plan(name, job) for name, job in jobs.items()}
        left = sum(len(t) for t in todo.values())
        if left:
            cmds, sizes = [], []
            for name, job in jobs.items():
                if todo[name]:
                    n = max(1, round(self.workers() * len(todo[name]) / left))
                    shard_cmds, shards = self.worker_commands(todo[name], job, n)
                    cmds += shard_cmds
                    sizes.append(f"{name}: {'+'.join(str(len(sh)) for sh in shards)}")
            env = child_env(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
            codes, stopped, seconds = run_eval_workers(
                cmds, env, self.runner, self.args.device, self.log,
                f"eval: {len(cmds)} workers started (prompts per worker, {'; '.join(sizes)}); logs in each "
                "eval folder's attempt-NN/")
            self.runner.add_time("eval_s", seconds)
            failed = [k for k, code in enumerate(codes) if code != 0 and not (stopped and code < 0)]
            if failed:
                tail = cmds[failed[0]][1].read_text(errors="replace")[-3000:]
                raise ChildFailed(f"eval workers failed ({len(failed)} of {len(cmds)}, exit codes "
                                  f"{[codes[k] for k in failed]}: negative = killed by that signal); "
                                  f"{cmds[failed[0]][1]} ends:\n{tail}")
        return {name: self.decode_report(name, job) for name, job in jobs.items()}

    def decode_plan(self, name: str, job: "DecodeJob") -> list[dict]:
        """The job's prompts still to decode; its eval folder made (moved aside first when it holds records of
        other prompts, settings or drafter weights) and its plan written."""
        key = hashlib.sha256(json.dumps({
            "items": [[i["dataset"], i["id"], i["turns"]] for i in job.items],
            "settings": job.settings.__dict__, "drafter": _file_sha256(job.drafter / "model.safetensors"),
        }, sort_keys=True, default=list).encode()).hexdigest()
        plan_path = job.eval_dir / "plan.json"
        if plan_path.is_file() and json.loads(plan_path.read_text()).get("key") != key:
            old = job.eval_dir.with_name(f"{job.eval_dir.name}-stale-{int(time.time())}")
            self.log(f"eval {name}: prompts, settings or drafter changed since the last call: moving "
                     f"{job.eval_dir} to {old}")
            job.eval_dir.rename(old)
            self.runner.clear_time("eval_s")
        job.eval_dir.mkdir(parents=True, exist_ok=True)
        plan_path.write_text(json.dumps({"key": key, "settings": job.settings.__dict__, "datasets": job.info},
                                        indent=1, default=list))
        done = read_records(job.eval_dir.glob("records-*.jsonl"))
        todo = [i for i in job.items if record_key(i["dataset"], i["id"]) not in done]
        self.log(f"eval {name}: {len(job.items)} prompts, {len(job.items) - len(todo)} already done, {len(todo)} "
                 "to decode")
        return todo

    def worker_commands(self, todo: list[dict], job: "DecodeJob", n: int) -> tuple[list[tuple[list[str], Path]], list]:
        """The worker processes (command, log file) that decode `todo` with the job's drafter in `n` shards
        (records appended per prompt, up to the deadline), and the shards."""
        shards = plan_shards(todo, min(n, len(todo)))
        attempt = len(list(job.eval_dir.glob("attempt-*")))
        adir = job.eval_dir / f"attempt-{attempt:02d}"
        adir.mkdir()
        deadline = None if self.runner.deadline is None else self.runner.deadline - self.args.eval_stop_margin_s
        cmds = []
        for k, shard in enumerate(shards):
            items_file = adir / f"items-{k:02d}.jsonl"
            items_file.write_text("".join(json.dumps(i) + "\n" for i in shard), encoding="utf-8")
            cmd = [sys.executable, str(Path(__file__).resolve()), "worker", "--target", self.cfg.target.path,
                   "--drafter", str(job.drafter), "--items", str(items_file),
                   "--settings", json.dumps(job.settings.__dict__, default=list),
                   "--out", str(job.eval_dir / f"records-{attempt:02d}-{k:02d}.jsonl")]
            cmds.append((cmd + (["--deadline", str(deadline)] if deadline is not None else []),
                         adir / f"worker-{k:02d}.log"))
        return cmds, shards

    def decode_report(self, name: str, job: "DecodeJob") -> tuple[bool, dict]:
        """(complete, the job's eval info with its merged report under "_report") from its records so far."""
        from dflash_train.infer.evaluate import report_config

        done = read_records(job.eval_dir.glob("records-*.jsonl"))
        missing = {record_key(i["dataset"], i["id"]) for i in job.items} - set(done)
        finished = [i for i in job.items if record_key(i["dataset"], i["id"]) not in missing]
        config = report_config(job.settings.max_new_tokens, job.settings.temperature, drafter_block_size(job.drafter),
                               job.settings.tree_budgets)
        report = merged_report(config, finished, done, job.settings.mode_names())
        (job.eval_dir / "report.json").write_text(json.dumps(report, indent=1))
        job.info["_worker_prompt_s"] = round(sum(r.get("wall_s", 0.0) for r in done.values()), 1)
        job.info["_report"] = report
        if missing:
            self.log(f"eval {name}: {len(missing)} of {len(job.items)} prompts still to decode: run the same command "
                     "again")
        return not missing, job.info

    # ------------------------------------------------------------------ tau by replay

    def replay_drafters(self) -> dict[str, Path]:
        """Exported drafters to replay by name: each run's export and, with --curve-every, each checkpoint of
        the default run (exported once to curve/step-N)."""
        if self.given_drafter is not None:
            return {"default": self.given_drafter}
        out = {name: run / "export" for name, (run, _) in self.runs().items() if name not in self.failed}
        if self.args.curve_every:
            from dflash_train.export import export_checkpoint
            from dflash_train.layout import list_checkpoints

            for ckpt in list_checkpoints(self.run / "checkpoints"):
                step = int(ckpt.name.split("-")[1])
                folder = self.out / "curve" / f"step-{step:08d}"
                if not (folder / "model.safetensors").is_file():
                    export_checkpoint(ckpt, folder, "float32")
                out[f"step-{step:08d}"] = folder
        return out

    def stage_replay(self, items: list[dict]) -> dict[str, dict[str, dict]]:
        """Tau by replay of every eval prompt for every drafter: `{name: {record key: record}}`. The target's
        greedy continuations (the corpus) are made once and shared."""
        rdir = self.out / "replay"
        rdir.mkdir(parents=True, exist_ok=True)
        (rdir / "partial").mkdir(exist_ok=True)
        drafters = self.replay_drafters()
        # the widest step a drafter verifies: the anchor and its drafts (a DSpark block of B slots drafts B)
        block = 1 + max(drafter_facts(d)["drafts_per_block"] for d in drafters.values())
        settings = EvalSettings(**{**self.settings.__dict__, "baseline": False})
        corpus_key = hashlib.sha256(json.dumps({
            "items": [[i["dataset"], i["id"], i["turns"]] for i in items], "target": self.cfg.target.path,
            "max_new": settings.max_new_tokens, "block": block, "dtype": settings.dtype,
            "target_quantize": settings.target_quantize,
        }, sort_keys=True).encode()).hexdigest()
        corpus = rdir / f"corpus-{corpus_key[:16]}.jsonl"
        me, settings_json = str(Path(__file__).resolve()), json.dumps(settings.__dict__, default=list)
        t0 = time.time()
        if not corpus.is_file():
            items_file = rdir / "items.jsonl"
            items_file.write_text("".join(json.dumps(i) + "\n" for i in items), encoding="utf-8")
            self.log(f"replay: generating the target's greedy continuations of {len(items)} prompts -> {corpus}")
            run_helpers([[sys.executable, me, "corpus", "--target", self.cfg.target.path, "--items", str(items_file),
                          "--block-size", str(block), "--settings", settings_json, "--out", str(corpus)]],
                        rdir, "corpus", self.runner, self.args.device, self.log)
            self.runner.add_time("corpus_s", time.time() - t0)
        thresholds = ",".join(f"{c:g}" for c in self.args.confidence_thresholds)
        truncation = ["--confidence-thresholds", thresholds] if thresholds else []
        keys = {name: hashlib.sha256((corpus_key + _file_sha256(d / "model.safetensors") + settings_json
                                      + (f"conf:{thresholds}" if thresholds else "")).encode())
                .hexdigest() for name, d in drafters.items()}
        known = json.loads((rdir / "keys.json").read_text()) if (rdir / "keys.json").is_file() else {}
        todo = [n for n in drafters if known.get(n) != keys[n] or not (rdir / f"{n}.jsonl").is_file()]
        if todo:
            # one process per drafter (each appends its records turn by turn): the walk is host-bound Python, so
            # processes overlap well on a GPU; on CPU one process for all (the target pass is shared)
            shards = [[n] for n in todo] if visible_gpus(self.args.device) else [todo]
            self.log(f"replay: {len(todo)} drafter(s) over {len(shards)} process(es): {', '.join(todo)}")
            t1 = time.time()
            run_helpers([[sys.executable, me, "replay", "--target", self.cfg.target.path, "--corpus", str(corpus),
                          "--settings", settings_json, "--out-dir", str(rdir)] + truncation
                         + [a for n in shard for a in ("--drafter", f"{n}={drafters[n]}",
                                                       "--partial", f"{n}={self.replay_partial(n, keys[n])}")]
                         for shard in shards],
                        rdir, "replay", self.runner, self.args.device, self.log)
            self.runner.add_time("replay_s", time.time() - t1)
            known.update({n: keys[n] for n in todo})
            (rdir / "keys.json").write_text(json.dumps(known, indent=1))
        return {name: read_records([rdir / f"{name}.jsonl"]) for name in drafters}

    def replay_partial(self, name: str, key: str) -> Path:
        """Where drafter `name`'s replay appends its turn records (`key`: the drafter, corpus and settings, so a
        changed drafter starts afresh)."""
        return self.out / "replay" / "partial" / f"{name}-{key[:16]}.jsonl"

    def eval_by_replay(self, items: list[dict], info: dict) -> tuple[bool, dict, dict]:
        """Replay every drafter on every eval prompt; with --check-decode, decode some prompts for real too.
        Returns (complete, eval info of the default drafter, the replay sections of the summary)."""
        from dflash_train.infer.evaluate import report_config

        records = self.stage_replay(items)
        drafters = self.replay_drafters()
        facts = {name: drafter_facts(d) for name, d in drafters.items()}
        modes = EvalSettings(**{**self.settings.__dict__, "baseline": False}).mode_names()  # every drafter's, at most
        own = {name: self.settings_for(d, baseline=False) for name, d in drafters.items()}  # no DDTree where refused
        reports = {name: merged_report(report_config(own[name].max_new_tokens, own[name].temperature,
                                                     facts[name]["block_size"], own[name].tree_budgets),
                                       items, recs, own[name].mode_names())
                   for name, recs in records.items()}
        self.eval_dir.mkdir(parents=True, exist_ok=True)
        (self.eval_dir / "report.json").write_text(json.dumps(reports["default"], indent=1))
        info["_report"], info["_worker_prompt_s"] = reports["default"], None
        pooled_names = [n for n in POOLED if n in reports["default"]["datasets"]]
        by_slot = {name: {"drafter": facts[name],
                          "modes": acceptance_by_slot(reports[name], own[name].mode_names(),
                                                      facts[name]["drafts_per_block"], pooled_names)}
                   for name in reports}
        (self.out / "acceptance_by_slot.json").write_text(json.dumps(by_slot, indent=1))
        extra: dict = {"method": "replay", "argmax_mismatches": {
            name: sum(r.get("replay", {}).get("argmax_mismatches", 0) for r in recs.values())
            for name, recs in records.items()}}
        if self.given_drafter is None:
            extra["variants"] = {name: variant_row(self.variants.get(name, []), self.failed.get(name), reports.get(name),
                                                   train_summary(run), modes, pooled_names,
                                                   self.runner.times.get("train_s" if name == "default" else f"train_s:{name}"),
                                                   by_slot.get(name))
                                 for name, (run, _) in self.runs().items()}
        if self.args.confidence_thresholds:
            extra["confidence_truncation"] = self.truncation_section(items, records, facts, reports, pooled_names)
        if self.args.curve_every and self.given_drafter is None:
            times = metric_times(self.run)
            extra["curve"] = [{"step": int(name.split("-")[1]), "train_s_after_first_log": times.get(int(name.split("-")[1])),
                               "tau_mt-bench+sharegpt": pooled_tau(reports[name], modes, pooled_names),
                               "tau_all": pooled_tau(reports[name], modes)}
                              for name in sorted(n for n in reports if n.startswith("step-"))]
        complete = True
        if self.args.check_decode:
            complete, extra["decode_check"] = self.decode_check(items, info, records, drafters)
        return complete, info, extra

    def truncation_section(self, items: list[dict], records: dict[str, dict[str, dict]], facts: dict[str, dict],
                           reports: dict[str, dict], pooled_names: list[str]) -> dict:
        """--confidence-thresholds: the summary's confidence truncation section, per drafter with a confidence head
        (`confidence_truncation`); its truncated modes are kept out of the reports of the other tables."""
        from dflash_train.infer.evaluate import report_config
        from dflash_train.infer.replay import confidence_mode

        thresholds = tuple(self.args.confidence_thresholds)
        modes = [confidence_mode(c) for c in thresholds]
        drafters = {}
        for name, recs in records.items():
            if facts[name]["confidence_head"]:
                truncated = merged_report(report_config(self.settings.max_new_tokens, 0.0, facts[name]["block_size"],
                                                        ()), items, recs, modes)
                drafters[name] = confidence_truncation(reports[name], truncated, thresholds,
                                                       facts[name]["drafts_per_block"], pooled_names)
        return {"thresholds": list(thresholds), "drafters": drafters}

    def decode_check(self, items: list[dict], info: dict, replayed: dict[str, dict[str, dict]],
                     drafters: dict[str, Path]) -> tuple[bool, dict]:
        """--check-decode N: the first N prompts of each set decoded for real with every trained drafter (the
        default's with the target alone too: its speedup and lossless check), all at once, and compared with their
        replay turn by turn: (complete, the summary's decode_check section)."""
        per_ds: dict[str, int] = {}
        check_items = []
        for item in items:
            if per_ds.get(item["dataset"], 0) < self.args.check_decode:
                per_ds[item["dataset"]] = per_ds.get(item["dataset"], 0) + 1
                check_items.append(item)
        names = [n for n in drafters if not n.startswith("step-")]  # the trained runs, not the curve's checkpoints
        check_info = {k: dict(v) for k, v in info.items() if not k.startswith("_")}
        jobs = {name: DecodeJob(drafters[name], check_items, json.loads(json.dumps(check_info)),
                                self.out / "eval-decode" / name,
                                self.settings_for(drafters[name], baseline=name == "default"))
                for name in names}
        done = self.decode_jobs(jobs)
        checks = {}
        for name, (_, job_info) in done.items():
            rep = job_info["_report"]
            decoded = {record_key(r["dataset"], r["id"]): r for r in rep["outputs"]}
            checks[name] = {
                "agreement": compare_with_decoding(decoded, replayed[name],
                                                   [m for m in jobs[name].settings.mode_names() if m != "target"]),
                "lossless_mismatches": (sum(len(b["lossless_mismatches"]) for b in rep["datasets"].values())
                                        if jobs[name].settings.baseline else None)}
        rep = done["default"][1]["_report"]
        return all(c for c, _ in done.values()), {
            "prompts": len(check_items), "per_dataset": per_ds, "drafters": checks,
            "speedup": {ds: {m: b["modes"][m].get("speedup") for m in b["modes"] if m != "target"}
                        for ds, b in rep["datasets"].items()},
            "decode_tokens_per_s": {ds: {m: b["modes"][m]["decode_tokens_per_s"] for m in b["modes"]}
                                    for ds, b in rep["datasets"].items()},
        }

    # ------------------------------------------------------------------ summary

    def summarize(self, complete: bool, info: dict, extra: Optional[dict] = None) -> dict:
        """summary.json and summary.md of this call's eval (and what was trained); returns the summary."""
        report = info.pop("_report")
        worker_s = info.pop("_worker_prompt_s")
        if self.given_drafter is None:
            manifest = json.loads((self.prepared / "manifest.json").read_text())
            data = {"file": str(self.args.data), "rows_read": manifest["counts"]["rows_read"],
                    "rows_kept": manifest["counts"]["kept"], "rejected": manifest["counts"]["rejected"],
                    "train_rows": manifest["splits"]["train"]["rows"], "val_rows": manifest["splits"]["val"]["rows"]}
            if self.regen:
                data["regen"] = self.regen_summary()
            train = train_summary(self.run)
        else:  # not trained here: the run directory beside an export (run/export), when there is one
            data = {"file": self.overlap_data, "used_for": "the overlap filter only (drafter given)"}
            run = self.given_drafter.parent
            train = train_summary(run) if (run / "metrics.jsonl").is_file() else {"records": 0}
        datasets = dataset_summaries(report, info)
        summary = {
            "complete": complete,
            "reference": REFERENCE,
            "config": str(self.args.config),
            "overrides": list(self.args.overrides),
            "drafter": drafter_origin(self.drafter_dir, self.given_drafter is not None),
            "data": data,
            "train": train,
            "eval": {"settings": {**self.settings.__dict__, "tree_budgets": list(self.settings.tree_budgets),
                                  "overlap_prefix_chars": self.args.overlap_prefix,
                                  "overlap_filter_data": self.overlap_data, "workers": self.workers()},
                     "datasets": datasets,
                     "pooled_tau": pooled_by_mode(datasets, [m for m in self.settings.mode_names() if m != "target"]),
                     "worker_prompt_s": worker_s},
            "wall_s": self.runner.times,
            "dropped_ids": {n: m["dropped_ids"] for n, m in info.items()},
            "method": "decode",
            **(extra or {}),
        }
        (self.out / "summary.json").write_text(json.dumps(summary, indent=1, default=list))
        (self.out / "summary.md").write_text(summary_markdown(summary))
        return summary


def dataset_summaries(report: dict, info: dict) -> dict[str, dict]:
    """The summary's per-dataset entries: what was evaluated and dropped, tau and histogram per mode."""
    datasets = {}
    for name, meta in info.items():
        body = report["datasets"].get(name, {"modes": {}, "lossless_mismatches": []})
        meta = {k: v for k, v in meta.items() if k != "dropped_ids"}
        walls = [r.get("wall_s", 0.0) for r in report["outputs"] if r["dataset"] == name]
        datasets[name] = {**meta, "prompts_done": len(walls),
                          "mean_prompt_wall_s": round(sum(walls) / len(walls), 3) if walls else None,
                          "modes": {m: {k: s[k] for k in ("tau", "steps", "tokens", "histogram", "decode_tokens_per_s",
                                                          "speedup") if k in s}
                                    for m, s in body["modes"].items()},
                          "lossless_mismatches": len(body["lossless_mismatches"])}
    return datasets


def pooled_by_mode(datasets: dict[str, dict], modes: list[str]) -> dict[str, dict]:
    """Tau per mode over the steps of MT-Bench + ShareGPT (the reference's sets) and of every set."""
    pooled: dict[str, dict] = {}
    for mode in modes:
        for label, names in (("mt-bench+sharegpt", [n for n in POOLED if n in datasets]), ("all", list(datasets))):
            stats = [datasets[n]["modes"].get(mode, {}) for n in names]
            steps = sum(s.get("steps", 0) for s in stats)
            gained = sum(s.get("tau", 0) * s.get("steps", 0) for s in stats)
            pooled.setdefault(label, {})[mode] = gained / steps if steps else None
    return pooled


def variant_row(overrides: list[str], failed: Optional[str], report: Optional[dict], train: dict, modes: list[str],
                pooled_names: list[str], train_wall_s: Optional[float], by_slot: Optional[dict] = None) -> dict:
    """One recipe's line of "Recipes at equal steps": the drafter (architecture, drafts per block, whether DDTree
    applies), training, tau per mode pooled and per dataset (None: the mode does not apply to the drafter), and the
    block walk's conditional acceptance per slot over MT-Bench + ShareGPT with, for a confidence head, its mean
    prediction (`by_slot`: the drafter's entry of acceptance_by_slot.json)."""
    if failed is not None:
        return {"overrides": overrides, "failed": failed}
    row = {"overrides": overrides, "steps": train.get("steps"), "accuracy_mean_last": train.get("accuracy_mean_last"),
           "train_wall_s": train_wall_s, "loop_s": train.get("loop_s"),
           "tau_mt-bench+sharegpt": pooled_tau(report, modes, pooled_names), "tau_all": pooled_tau(report, modes),
           "tau_by_dataset": {ds: {m: (b["modes"][m]["tau"] if m in b["modes"] else None) for m in modes}
                              for ds, b in report["datasets"].items()}}
    if by_slot is not None:
        facts = by_slot["drafter"]
        row.update({k: facts[k] for k in ("architecture", "block_size", "drafts_per_block", "confidence_head")})
        row["tree_not_applicable"] = facts["tree"]
        block = by_slot["modes"]["block"]["pooled"]["mt-bench+sharegpt"]
        row["block_by_slot_mt-bench+sharegpt"] = {k: block[k] for k in ("acceptance", "predicted", "reached")}
        # the steps that accepted every draft: what a block one draft shorter would have cut (tau moves by about
        # this share), for comparisons at unequal drafts per block
        row["every_draft_accepted_mt-bench+sharegpt"] = (block["accepted"][-1] / block["reached"][0]
                                                         if block["reached"][0] else None)
    return row


def drafter_block_size(folder: Path) -> int:
    return int(json.loads((Path(folder) / "config.json").read_text())["block_size"])


def drafter_facts(folder: Path) -> dict:
    """What the comparison reads off an exported drafter, from its config.json alone (the drafter built on the meta
    device, no weights read): its architecture, block size, tokens drafted per block (`Drafter.num_drafts`: B - 1,
    or B where the anchor's slot drafts too), whether it has a confidence head, and why DDTree does not apply to
    it (`tree`: the refusal, None where it applies)."""
    import torch

    from dflash_train.algorithms import architecture_of_export
    from dflash_train.infer.replay import tree_refusal

    data = json.loads((Path(folder) / "config.json").read_text())
    arch = architecture_of_export(data)
    with torch.device("meta"):
        drafter = arch.drafter_class(arch.config_from_dict(data))
    return {"architecture": drafter.architecture, "block_size": int(drafter.block_size),
            "drafts_per_block": int(drafter.num_drafts()), "confidence_head": bool(drafter.has_confidence),
            "tree": tree_refusal(drafter)}


def acceptance_by_slot(report: dict, modes: list[str], width: int, pooled_names: list[str]) -> dict:
    """Per mode, the conditional acceptance of each drafted slot (`replay.slot_acceptance`: with the mean predicted
    acceptance of a confidence head, block mode) per dataset and pooled over `pooled_names` and over all sets."""
    from dflash_train.infer.replay import slot_acceptance

    out = {}
    for mode in modes:
        by_ds: dict[str, list[dict]] = {}
        for rec in report["outputs"]:
            by_ds.setdefault(rec["dataset"], []).extend(rec["modes"][mode])
        out[mode] = {"datasets": {ds: slot_acceptance(outs, width) for ds, outs in by_ds.items()},
                     "pooled": {"mt-bench+sharegpt": slot_acceptance([o for ds in pooled_names
                                                                          for o in by_ds.get(ds, [])], width),
                                "all": slot_acceptance([o for outs in by_ds.values() for o in outs], width)}}
    return out


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def train_summary(run: Path, last_n: int = 10) -> dict:
    """Steps, loss, accuracy per block position (last record, and the mean of the last `last_n` records:
    each record is one training batch, teacher-forced) and timings of a run directory."""
    from dflash_train.run.metrics import read_metrics

    records = []
    if (run / "metrics.jsonl").is_file():
        for r in read_metrics(run):
            if r.get("kind") != "validation":
                records.append(r)
    out: dict = {"records": len(records)}
    if records:
        last, tail = records[-1], records[-last_n:]
        width = len(last["accuracy_per_position"])
        mean_pos = []
        for k in range(width):
            vals = [r["accuracy_per_position"][k] for r in tail if r["accuracy_per_position"][k] is not None]
            mean_pos.append(sum(vals) / len(vals) if vals else None)
        out.update({
            "steps": last["step"], "epoch": last["epoch"], "loss": last["loss"], "accuracy": last["accuracy"],
            "tau_estimate": last["tau_estimate"],
            "tau_estimate_mean_last": sum(r["tau_estimate"] for r in tail) / len(tail),
            "accuracy_mean_last": sum(r["accuracy"] for r in tail) / len(tail),
            "accuracy_per_position": last["accuracy_per_position"],
            "accuracy_per_position_mean_last": mean_pos, "mean_over_last_records": len(tail),
            "tokens_per_s_mean": sum(r["tokens_per_s"] for r in records) / len(records),
        })
    status = run / "status.json"
    if status.is_file():
        st = json.loads(status.read_text())
        out["warmup_s"] = st.get("warmup_s")
        out["phase"] = st.get("phase")
    log = run / "train.log"
    if log.is_file():
        loops = re.findall(r"done: (\d+) steps in (\d+) s", log.read_text(errors="replace"))
        if loops:
            out["loop_s"] = float(loops[-1][1])
    return out


def _mean(values) -> Optional[float]:
    vals = [v for v in values or [] if v is not None]
    return sum(vals) / len(vals) if vals else None


def _fmt(v, nd=3) -> str:
    return "-" if v is None else (f"{v:.{nd}f}" if isinstance(v, float) else str(v))


def _share(v: Optional[float]) -> str:
    return "-" if v is None else f"{100 * v:.3f}%"


def summary_markdown(s: dict) -> str:
    ev, tr = s["eval"], s["train"]
    modes = [m for m in next(iter(ev["datasets"].values()), {}).get("modes", {}) if m != "target"] if ev["datasets"] else []
    lines = ["# DFlash drafter quality", ""]
    if not s["complete"]:
        lines += ["**Incomplete**: some prompts are still to decode (run the same command again).", ""]
    ref = s["reference"]
    dr = s.get("drafter") or {}
    if "train_rows" in s["data"]:
        regen = s["data"].get("regen")
        made = (f", regenerated by the target from the first {regen['conversations'] + regen['rejected']} "
                f"conversations of the built-in ShareGPT training split (greedy, {regen['max_new_tokens']} new tokens "
                f"a turn; {regen['rejected']} rejected)") if regen else f" from `{s['data'].get('file')}`"
        ours = (f"Ours: `{s['config']}` {' '.join(s['overrides'])}; data {s['data']['train_rows']} training rows "
                f"({s['data']['rows_read']} read){made}.")
    else:
        ours = f"Ours: the drafter below, target from `{s['config']}`{''.join(' ' + o for o in s['overrides'])}."
    filtered = ("all prompts after dropping training prompts" if ev["settings"].get("overlap_filter_data", True)
                else "all prompts (NOT filtered against training prompts: the training file was not given)")
    lines += [f"Reference: {ref['trainer']}, {ref['recipe']}: tau ~{ref['tau']} ({ref['tau_on']}).",
              f"{ours} Eval: greedy, {ev['settings']['max_new_tokens']} new tokens, "
              f"{ev['settings']['dtype']}"
              + (", the target in FP8 (every decoder layer, as served)"
                 if ev["settings"].get("target_quantize", "none") == "fp8" else "")
              + f", {filtered}.", ""]
    if dr:
        origin = [f"model sha256 {dr['model_sha256'][:16]}..."]
        if dr.get("exported_from"):
            origin.append(f"exported from `{dr['exported_from']}`")
        tr_cfg = dr.get("training") or {}
        if tr_cfg.get("max_steps"):
            origin.append(f"{tr_cfg['max_steps']} steps on {tr_cfg.get('train_files')}")
        lines += [f"Drafter: {dr['source']}: `{dr['path']}` ({'; '.join(origin)}).", ""]
    lines += [
              "| dataset | prompts (turns) | dropped as training prompts (exact / prefix) | "
              + " | ".join(f"tau {m}" for m in modes) + " | tokens (block) |",
              "|---|---|---|" + "---|" * len(modes) + "---|"]
    for name, d in ev["datasets"].items():
        taus = " | ".join(_fmt(d["modes"].get(m, {}).get("tau")) for m in modes)
        lines.append(f"| {name} | {d['prompts_done']}/{d['prompts']} ({d['turns']}) | {d['dropped_overlap']['exact']} / "
                     f"{d['dropped_overlap']['prefix']} | {taus} | {d['modes'].get('block', {}).get('tokens', '-')} |")
    for label, taus in ev["pooled_tau"].items():
        lines.append(f"| pooled: {label} | | | " + " | ".join(_fmt(taus.get(m)) for m in modes) + " | |")
    lines += ["", f"Reference tau ~{ref['tau']} compares with the pooled mt-bench+sharegpt block tau.", ""]
    if tr.get("accuracy_per_position"):
        width = len(tr["accuracy_per_position"])
        lines += ["## Accuracy per block position (training, teacher-forced)", "",
                  "| | " + " | ".join(str(k + 1) for k in range(width)) + " |",
                  "|---|" + "---|" * width,
                  f"| step {tr['steps']} | " + " | ".join(_fmt(a, 2) for a in tr["accuracy_per_position"]) + " |",
                  f"| mean of last {tr['mean_over_last_records']} records | "
                  + " | ".join(_fmt(a, 2) for a in tr["accuracy_per_position_mean_last"]) + " |", "",
                  f"Final loss {_fmt(tr['loss'])}, accuracy {_fmt(tr['accuracy'])}, tau estimate "
                  f"{_fmt(tr['tau_estimate'])} (mean of last records {_fmt(tr['tau_estimate_mean_last'])}), "
                  f"{_fmt(tr['tokens_per_s_mean'], 0)} target tokens/s.", ""]
    w = s["wall_s"]
    lines += ["## Wall time", ""]
    if w.get("regen_s") is not None:
        lines.append(f"- data (regen): {_fmt(w.get('regen_s'), 1)} s")
    lines += [f"- prepare: {_fmt(w.get('prepare_s'), 1)} s",
              f"- train: {_fmt(w.get('train_s'), 1)} s for the training process(es) (target load, compile warm-up "
              f"{_fmt(tr.get('warmup_s'), 1)} s, loop {_fmt(tr.get('loop_s'), 1)} s); reference ~{ref['train_wall_s']} s",
              (f"- eval by replay: {_fmt(w.get('corpus_s'), 1)} s for the target's greedy continuations, "
               f"{_fmt(w.get('replay_s'), 1)} s to replay every drafter"
               + (f"; real decoding of the check prompts {_fmt(w.get('eval_s'), 1)} s" if s.get("decode_check") else "")
               if s.get("method") == "replay" else
               f"- eval: {_fmt(w.get('eval_s'), 1)} s with {ev['settings']['workers']} parallel workers "
               f"({_fmt(ev['worker_prompt_s'], 1)} s of per-prompt decoding summed over workers)"), ""]
    lines += replay_markdown(s, modes)
    hist_mode = "block"
    lines += [f"## Accepted tokens per step ({hist_mode})", ""]
    for name, d in ev["datasets"].items():
        hist = d["modes"].get(hist_mode, {}).get("histogram", {})
        lines.append(f"- {name}: " + ", ".join(f"{k}: {v}" for k, v in hist.items()))
    return "\n".join(lines) + "\n"


def replay_markdown(s: dict, modes: list[str]) -> list[str]:
    """The sections only a replay run has: the method, the variants, the curve, the check against decoding."""
    if s.get("method") != "replay":
        return []
    lines = ["## Method", "",
             "Tau by replay (`dflash_train.infer.replay`): the target's greedy continuation of every prompt, then "
             "every step's acceptance from one drafter pass; equal to real greedy speculative decoding up to "
             "floating-point ties (see the check below). Positions where the full-sequence target pass disagrees "
             f"with the batched greedy continuation: {s.get('argmax_mismatches')}.", ""]
    lines += variants_markdown(s.get("variants") or {}, modes)
    lines += truncation_markdown(s.get("confidence_truncation"))
    if s.get("curve"):
        lines += ["## Tau against training time (default recipe)", "",
                  "| step | train s after the first logged step | " + " | ".join(f"tau {m} (MT-Bench+ShareGPT)" for m in modes)
                  + " | " + " | ".join(f"tau {m} (all)" for m in modes) + " |",
                  "|---|---|" + "---|" * (2 * len(modes))]
        for c in s["curve"]:
            lines.append(f"| {c['step']} | {_fmt(c['train_s_after_first_log'], 1)} | "
                         + " | ".join(_fmt(c["tau_mt-bench+sharegpt"].get(m)) for m in modes) + " | "
                         + " | ".join(_fmt(c["tau_all"].get(m)) for m in modes) + " |")
        lines.append("")
    check = s.get("decode_check")
    if check:
        lines += ["## Check: real speculative decoding of the first prompts of each set", "",
                  f"{check['prompts']} prompts ({check['per_dataset']}) decoded step by step with each drafter, the "
                  "default's with the target alone too, and compared with their replay turn by turn (identical tokens "
                  "are the target's greedy output: replay reads it).", "",
                  "| drafter | mode | turns | identical tokens | identical accept lengths | tau decoded | tau replayed "
                  "| outputs differing from the target alone |",
                  "|---|---|---|---|---|---|---|---|"]
        for name, c in check["drafters"].items():
            for m, a in c["agreement"].items():
                lines.append(f"| {name} | {m} | {a['turns']} | {a['identical_tokens']} | {a['identical_accept_lengths']} | "
                             f"{_fmt(a['tau_decoded'])} | {_fmt(a['tau_replayed'])} | {_fmt(c['lossless_mismatches'])} |")
        lines += ["", "| dataset (default drafter) | " + " | ".join(f"speedup {m}" for m in modes)
                  + " | target alone tok/s |", "|---|" + "---|" * (len(modes) + 1)]
        for ds, sp in check["speedup"].items():
            lines.append(f"| {ds} | " + " | ".join(f"{_fmt(sp.get(m), 2)}x" if sp.get(m) else "-" for m in modes)
                         + f" | {_fmt(check['decode_tokens_per_s'][ds].get('target'), 1)} |")
        lines.append("")
    return lines


def truncation_markdown(section: Optional[dict]) -> list[str]:
    """--confidence-thresholds: tau and tokens verified per step of block decoding truncated at each threshold, per
    drafter with a confidence head, beside untruncated block decoding."""
    if not section:
        return []
    lines = ["## Confidence truncation (block)", "",
             "Each step verifies only the drafts before the first whose predicted acceptance is below the threshold "
             "(eval --confidence-threshold; lossless). Verified per step: the anchor and the drafts the target "
             "checks (eval's verified_per_step).", "",
             "| drafter | threshold | tau (MT-Bench+ShareGPT) | tau (all) | verified per step (MT-Bench+ShareGPT) "
             "| verified per step (all) |", "|---|---|---|---|---|---|"]
    for name, d in section["drafters"].items():
        for row in d["modes"].values():
            lines.append(f"| {name} | {'none' if row['threshold'] is None else format(row['threshold'], 'g')} | "
                         f"{_fmt(row['tau_mt-bench+sharegpt'])} | {_fmt(row['tau_all'])} | "
                         f"{_fmt(row['verified_per_step_mt-bench+sharegpt'], 2)} | {_fmt(row['verified_per_step_all'], 2)} |")
    if not section["drafters"]:
        lines.append("| (no drafter with a confidence head) | | | | | |")
    return lines + [""]


def variants_markdown(variants: dict, modes: list[str]) -> list[str]:
    """The recipes side by side (more than one): drafter, training, tau per mode pooled and per dataset ("n/a"
    where a mode does not apply), conditional acceptance per slot, and the confidence heads' calibration."""
    if len(variants) < 2:
        return []
    ok = {n: v for n, v in variants.items() if "failed" not in v}

    def tau(v: dict, taus: dict, m: str) -> str:
        return "n/a" if m.startswith("tree-") and v.get("tree_not_applicable") else _fmt(taus.get(m))

    lines = ["## Recipes at equal steps", "",
             "| recipe | architecture | drafts per block | overrides | steps | train wall s | train accuracy | "
             + " | ".join(f"tau {m} (MT-Bench+ShareGPT)" for m in modes) + " | "
             + " | ".join(f"tau {m} (all)" for m in modes) + " | block steps accepting every draft |",
             "|---|---|---|---|---|---|---|" + "---|" * (2 * len(modes) + 1)]
    for name, v in variants.items():
        if "failed" in v:
            lines.append(f"| {name} | | | {' '.join(v['overrides'])} | training failed: {v['failed']} |")
            continue
        lines.append(f"| {name} | {v.get('architecture', '-')} | {_fmt(v.get('drafts_per_block'))} | "
                     f"{' '.join(v['overrides']) or '-'} | {_fmt(v['steps'])} | {_fmt(v['train_wall_s'], 1)} | "
                     f"{_fmt(v['accuracy_mean_last'])} | "
                     + " | ".join(tau(v, v["tau_mt-bench+sharegpt"], m) for m in modes) + " | "
                     + " | ".join(tau(v, v["tau_all"], m) for m in modes) + " | "
                     + _share(v.get("every_draft_accepted_mt-bench+sharegpt")) + " |")
    lines += ["", "Drafts per block: the tokens one step drafts (DFlash-family blocks of B slots draft B - 1, DSpark's "
              "B); compare recipes at equal drafts per block for equal verification width. Block steps accepting "
              "every draft (MT-Bench + ShareGPT): the share of steps a block one draft shorter would have cut short, "
              "about what one more or one less draft moves tau by. Train wall s: the "
              "training processes of this comparison shared the GPU(s) (the default had its own where there were "
              "several); compare tau at equal steps, not wall times. n/a: the drafter refuses DDTree.", ""]
    sets = list(dict.fromkeys(ds for v in ok.values() for ds in v["tau_by_dataset"]))
    if sets:
        lines += ["### Tau per dataset (" + " / ".join(modes) + ")", "",
                  "| recipe | " + " | ".join(sets) + " |", "|---|" + "---|" * len(sets)]
        for name, v in ok.items():
            lines.append(f"| {name} | " + " | ".join(" / ".join(tau(v, v["tau_by_dataset"].get(ds, {}), m) for m in modes)
                                                    for ds in sets) + " |")
        lines.append("")
    slots = {n: v["block_by_slot_mt-bench+sharegpt"] for n, v in ok.items() if v.get("block_by_slot_mt-bench+sharegpt")}
    if slots:
        width = max(len(t["acceptance"]) for t in slots.values())
        lines += ["### Conditional acceptance per drafted slot (block, MT-Bench + ShareGPT)", "",
                  "The share of the steps that reached a slot (every draft before it accepted) that accepted it too.",
                  "", "| recipe | " + " | ".join(str(k + 1) for k in range(width)) + " |", "|---|" + "---|" * width]
        for name, t in slots.items():
            lines.append(f"| {name} | " + " | ".join(_fmt(t["acceptance"][k], 2) if k < len(t["acceptance"]) else ""
                                                    for k in range(width)) + " |")
        lines.append("")
        calibrated = {n: t for n, t in slots.items() if t.get("predicted")}
        if calibrated:
            lines += ["### Confidence head calibration (block, MT-Bench + ShareGPT)", "",
                      "Per drafted slot: the mean predicted acceptance (the confidence head's sigmoid) over the steps "
                      "that reached the slot, against the acceptance measured there (above); steps: how many reached "
                      "it.", "", "| recipe | | " + " | ".join(str(k + 1) for k in range(width)) + " |",
                      "|---|---|" + "---|" * width]
            for name, t in calibrated.items():
                for label, key, nd in (("predicted", "predicted", 2), ("measured", "acceptance", 2), ("steps", "reached", 0)):
                    vals = t[key]
                    lines.append(f"| {name} | {label} | " + " | ".join(
                        (_fmt(vals[k], nd) if nd else str(vals[k])) if k < len(vals) else "" for k in range(width)) + " |")
            lines.append("")
    return lines


def parse_thresholds(text: str) -> tuple[float, ...]:
    """`0.2,0.4` -> (0.2, 0.4): confidence thresholds, each in (0, 1] (0 would truncate nothing)."""
    try:
        values = tuple(float(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: comma-separated numbers, e.g. 0.2,0.4") from None
    if not values or any(not 0 < c <= 1 for c in values):
        raise argparse.ArgumentTypeError(f"{text!r}: each threshold must be in (0, 1]")
    return tuple(dict.fromkeys(values))


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
                   help="data stage: conversations per generate call at most, turn by turn (wider is faster: "
                        "generation is host-bound); may change between calls (default: %(default)s)")
    p.add_argument("--regen-batch-tokens", type=int, default=REGEN_BATCH_TOKENS, metavar="N",
                   help="data stage: padded tokens per generate call at most, rows x (longest prompt + max new "
                        "tokens), which its memory grows with (the longest prompts' batch of 256 rows took ~77 GB); "
                        "lower it after an out-of-memory error, 0 = no bound (default: %(default)s)")
    p.add_argument("--regen-engine", choices=["generate", "continuous"], default="generate",
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
                   help="also train this recipe (the overrides on top of the default's), at the same time, and "
                        "replay it; repeat. The default run keeps GPU 0 to itself when there are several")
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
    from dflash_train.pipeline import RecipeMismatch

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
