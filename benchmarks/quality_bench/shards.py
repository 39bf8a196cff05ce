"""Eval prompts split over workers, and their per-prompt records merged back into one report."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Iterable


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
                 "model_sha256": file_sha256(folder / "model.safetensors"),
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

def file_sha256(path: Path) -> str:
    """The hex SHA-256 of a file (as summary.json and the stage keys hold it)."""
    from dflash_train.data.store import file_sha256 as prefixed

    return prefixed(path).removeprefix("sha256:")
