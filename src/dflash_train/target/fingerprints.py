"""sha256 fingerprints of a target's tokenizer and chat template: a prepared dataset's manifest and a
drafter's `dflash_train.json` record them, and training and eval refuse a target whose differ."""

from __future__ import annotations

import hashlib
import json
from typing import Any


def _sha256_json(obj: Any) -> str:
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"))
    return "sha256:" + hashlib.sha256(text.encode("utf-8")).hexdigest()


def tokenizer_fingerprint(tokenizer) -> str:
    """sha256 over the vocabulary (added tokens included), the special tokens and the added tokens with
    their flags: two tokenizers with the same fingerprint map every text to the same ids."""
    added = {
        str(i): {k: getattr(t, k, None) for k in ("content", "special", "lstrip", "rstrip", "normalized", "single_word")}
        for i, t in tokenizer.added_tokens_decoder.items()
    }
    special = {k: str(v) for k, v in getattr(tokenizer, "special_tokens_map", {}).items()}
    return _sha256_json({"vocab": tokenizer.get_vocab(), "special": special, "added": added})


def chat_template_text(tokenizer) -> str:
    template = getattr(tokenizer, "chat_template", None)
    if template is None:
        return ""
    if isinstance(template, dict):  # named templates
        return json.dumps(template, sort_keys=True)
    return str(template)


def chat_template_fingerprint(tokenizer) -> str:
    return "sha256:" + hashlib.sha256(chat_template_text(tokenizer).encode("utf-8")).hexdigest()
