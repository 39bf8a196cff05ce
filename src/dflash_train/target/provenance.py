"""What a drafter was trained against, recorded beside it (`dflash_train.json`) and checked before
eval or export: an "acceptance ~1.0 when served" often comes from a drafter used with
another tokenizer, chat template, RoPE setting or target than the one it learned."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from ..files.io import read_json_file, write_json_atomic
from .hf_config import text_config
from .fingerprints import chat_template_fingerprint, tokenizer_fingerprint

PROVENANCE_NAME = "dflash_train.json"


def _rope(config) -> dict[str, Any]:
    params = getattr(config, "rope_parameters", None)
    if params:
        return {k: v for k, v in dict(params).items()}
    out = {"rope_theta": getattr(config, "rope_theta", None)}
    if getattr(config, "rope_scaling", None):
        out.update(dict(config.rope_scaling))
    return out


def target_provenance(target_path: str, tokenizer, target_config, template_kwargs: Optional[dict] = None) -> dict:
    """`target_path`: how the record names the target. Training records what names it on another machine too
    (`assets.target_identity`: `smollm2` for the embedded default, not its converted folder in this machine's cache);
    files written before hold the folder it resolved to. No check reads it: the fingerprints below say whether a
    target is the one trained against."""
    t = text_config(target_config)
    return {
        "target": str(target_path),
        "tokenizer_sha256": tokenizer_fingerprint(tokenizer),
        "chat_template_sha256": chat_template_fingerprint(tokenizer),
        "template_kwargs": dict(template_kwargs or {}),
        "num_hidden_layers": int(t.num_hidden_layers),
        "hidden_size": int(t.hidden_size),
        "vocab_size": int(t.vocab_size),
        "rope": _rope(t),
        "pad_token_id": tokenizer.pad_token_id,
        "eos_token_id": tokenizer.eos_token_id,
    }


def serving_record(drafter) -> dict:
    """How the drafter is served, recorded beside it so that serving matches training: its architecture, trained
    block size and the number of speculative tokens one step drafts (`Drafter.num_drafts`: bs - 1 for DFlash,
    bs where the anchor is the first prediction); vLLM's `num_speculative_tokens`, one less than SGLang's
    `--speculative-num-draft-tokens`."""
    return {"architecture": drafter.architecture, "block_size": int(drafter.block_size),
            "num_speculative_tokens": int(drafter.num_drafts())}


def write_provenance(folder: Path, record: dict) -> None:
    write_json_atomic(Path(folder) / PROVENANCE_NAME, record)


def read_provenance(folder: Path) -> Optional[dict]:
    path = Path(folder) / PROVENANCE_NAME
    if not path.is_file():
        return None
    return read_json_file(path, f"export the drafter again or copy {folder} again")


def compare(trained: dict, current: dict, drafter, block_size: Optional[int] = None) -> list[str]:
    """Differences between what the drafter learned and what it is about to be used with."""
    problems = []
    labels = {
        "tokenizer_sha256": "tokenizer",
        "chat_template_sha256": "chat template",
        "template_kwargs": "chat template options (e.g. enable_thinking)",
        "num_hidden_layers": "target layer count",
        "hidden_size": "target hidden size",
        "vocab_size": "target vocabulary size",
        "rope": "target RoPE settings",
    }
    for key, label in labels.items():
        if key in trained and trained[key] != current.get(key):
            problems.append(f"{label}: trained with {trained[key]!r}, now {current.get(key)!r}")
    drafter_rope = _rope(drafter.config)
    if current.get("rope") and drafter_rope != current["rope"]:
        problems.append(f"RoPE: drafter config {drafter_rope!r}, target {current['rope']!r}")
    mask = drafter.mask_token_id
    for name in ("pad_token_id", "eos_token_id"):
        if current.get(name) is not None and mask == current[name]:
            problems.append(f"mask_token_id {mask} is the tokenizer's {name.split('_')[0]} token")
    recorded = trained.get("num_speculative_tokens")
    if recorded is not None and recorded != drafter.num_drafts():
        problems.append(f"{PROVENANCE_NAME} records {recorded} speculative tokens per step (the number it is served "
                        f"with), but the {drafter.architecture} drafter config.json describes drafts "
                        f"{drafter.num_drafts()} (block size {drafter.block_size}): the two files come from different "
                        "exports or versions; export the checkpoint again (dflash-train export)")
    if block_size is not None and block_size > drafter.block_size:
        problems.append(f"block size {block_size} is larger than the trained {drafter.block_size}")
    return problems
