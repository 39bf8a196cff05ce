"""The target's chat template, the one place it is applied: `prompt_ids` (what the target reads before it
writes the next assistant turn) and `tokenize_conversation` (a whole conversation; `loss_mask = 1` on
assistant tokens).

The template is rendered to text once per assistant turn prefix; an assistant turn's span is the
text the template adds between "history + generation prompt" and "history + this turn" (its
content and its end-of-turn marker). Tokens whose characters fall in such a span are supervised.
This works for any template, without `{% generation %}` markers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

ROLES = ("system", "user", "assistant")


class ConversationError(ValueError):
    """A conversation that cannot be tokenised; the message says why."""


@dataclass
class Tokenized:
    input_ids: np.ndarray  # int32 [S]
    loss_mask: np.ndarray  # uint8 [S]

    @property
    def num_supervised(self) -> int:
        return int(self.loss_mask.sum())


def check_messages(messages: Any) -> list[dict[str, str]]:
    if not isinstance(messages, list) or not messages:
        raise ConversationError("'messages' must be a non-empty list")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ConversationError(f"message {i} is not an object")
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise ConversationError(f"message {i} has role {role!r}; expected one of {ROLES}")
        if not isinstance(content, str) or not content.strip():
            raise ConversationError(f"message {i} ({role}) has empty or non-string content")
        out.append({"role": role, "content": content})
    if not any(m["role"] == "assistant" for m in out):
        raise ConversationError("no assistant turn to learn from")
    return out


def _render(tokenizer, messages: list[dict], add_generation_prompt: bool, template_kwargs: dict) -> str:
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt, **template_kwargs
    )


def prompt_ids(tokenizer, messages: list[dict[str, str]], template_kwargs: dict | None = None) -> list[int]:
    """`messages` (ending with a user turn) rendered with the generation prompt, as token ids."""
    text = _render(tokenizer, messages, True, template_kwargs or {})
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def tokenize_conversation(
    tokenizer, messages: list[dict[str, str]], max_length: int, template_kwargs: dict | None = None
) -> Tokenized:
    kwargs = template_kwargs or {}
    messages = check_messages(messages)
    full = _render(tokenizer, messages, False, kwargs)
    spans: list[tuple[int, int]] = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        prefix = _render(tokenizer, messages[:i], True, kwargs)
        upto = full if i == len(messages) - 1 else _render(tokenizer, messages[: i + 1], False, kwargs)
        if not upto.startswith(prefix) or not full.startswith(upto):
            raise ConversationError(
                "the chat template does not render conversations incrementally (a prefix changes when a turn is "
                "added), so assistant tokens cannot be located"
            )
        spans.append((len(prefix), len(upto)))
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids = np.asarray(enc["input_ids"], dtype=np.int32)
    starts = np.asarray([o[0] for o in enc["offset_mapping"]], dtype=np.int64)
    mask = np.zeros(len(ids), dtype=np.uint8)
    for lo, hi in spans:
        mask[(starts >= lo) & (starts < hi)] = 1
    return Tokenized(ids[:max_length], mask[:max_length])
