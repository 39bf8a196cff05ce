"""Which eval prompts are training prompts: normalised text, exact and prefix matches."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Iterable, Optional


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
