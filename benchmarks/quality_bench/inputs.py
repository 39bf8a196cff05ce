"""The stages' inputs: the prepared training data (reused while its bytes are unchanged) and the eval prompts."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable, Optional

from .overlap import OverlapIndex, drop_overlap, training_user_turns


def missing_inputs(eval_specs: list[str], regen: bool) -> list[str]:
    """What the stages to run will read but this machine lacks (an eval set's file or package, the ShareGPT package
    the data stage regenerates from), one line each saying what to do: checked before any stage runs, so that a
    missing eval set does not end a call after its training."""
    from dflash_train.data.formats import require_packages

    regen_source = ("the data stage (it regenerates the built-in ShareGPT split)", "sharegpt", "--data FILE")
    wanted = [regen_source] if regen else []
    for spec in eval_specs:
        name, _, source = spec.partition("=")
        wanted.append((f"--eval {spec}", source or name, f"--eval {name}=FILE"))
    problems = []
    for who, source, instead in wanted:
        try:
            require_packages([source])
        except FileNotFoundError as e:
            problems.append(f"{who}: {e} (or pass {instead})")
    return problems


def prepare_training_data(cfg, data: str, val_fraction: float, prepared: Path, log: Callable[[str], None]) -> Optional[float]:
    """`prepared` from the training file, unless it holds that file prepared with the same settings already.
    Returns the seconds spent preparing (None: reused)."""
    from dflash_train import assets
    from dflash_train.commands.prepare import PrepareConfig, prepare, summary
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
