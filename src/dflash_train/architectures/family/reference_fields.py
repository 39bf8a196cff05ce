"""The config fields of the reference drafters (z-lab/dflash) that change what decoding computes, read the reference
way: the output and input fields (`OutputFields`, `transform_logits`), the reduced draft vocabulary
(`draft_vocab_size_of`, `target_to_draft`) and each layer's attention kind (`AttentionKind`, `layer_kinds`)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import torch

# Newer reference drafters carry six fields that change what decoding computes. `draft_value` reads the three
# output/input fields the reference way; `layer_kinds` reads the three attention fields, which the reference reads
# from the top level of config.json only.


def draft_value(config: Any, name: str, default: Any) -> Any:
    """`config.dflash_config[name]` when that key is present, else the top-level `config.name`, else
    `default` (the reference's `_draft_value`). A null value reads as `default`."""
    dflash = getattr(config, "dflash_config", None) or {}
    value = dflash[name] if name in dflash else getattr(config, name, None)
    return default if value is None else value


def _number(config: Any, name: str, default: float) -> float:
    value = draft_value(config, name, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        where = "dflash_config." + name if name in (getattr(config, "dflash_config", None) or {}) else name
        raise ValueError(f"drafter config key '{where}' must be a finite number (got {value!r})")
    return float(value)


@dataclass(frozen=True)
class OutputFields:
    """What turns the drafter's final hidden states into scores, and what scales its block inputs:
    `logits = lm_head(h) * output_multiplier`, then `cap * tanh(logits / cap)` when the cap is set;
    block input embeddings (anchor and mask tokens, never the context features) `* input_embedding_scale`."""

    output_multiplier: float = 1.0
    final_logit_softcapping: Optional[float] = None  # None = off (a file's 0 or null reads as off)
    input_embedding_scale: float = 1.0

    @staticmethod
    def of(config: Any) -> "OutputFields":
        """Read from `dflash_config` first, then the top level, then the defaults; refuses non-numbers."""
        cap = _number(config, "final_logit_softcapping", 0.0)
        if cap < 0:
            raise ValueError(f"drafter config key 'final_logit_softcapping' must be >= 0 (0 or null = off; got {cap})")
        return OutputFields(_number(config, "output_multiplier", 1.0), cap or None,
                            _number(config, "input_embedding_scale", 1.0))


def transform_logits(logits: torch.Tensor, multiplier: float = 1.0, softcap: Optional[float] = None) -> torch.Tensor:
    """`logits * multiplier`, then `softcap * tanh(x / softcap)` when `softcap` (the reference's order)."""
    if multiplier != 1.0:
        logits = logits * multiplier
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    return logits


def draft_vocab_size_of(config: Any) -> int:
    """The top-level `draft_vocab_size` of a drafter config (vLLM's reduced draft vocabulary): 0 when absent or
    null (the target's vocabulary, through the target's lm_head), else an integer in 1..vocab_size."""
    n = getattr(config, "draft_vocab_size", None)
    if n is None:
        return 0
    vocab = getattr(config, "vocab_size", None)
    if isinstance(n, bool) or not isinstance(n, int) or n < 1 or (isinstance(vocab, int) and n > vocab):
        raise ValueError(f"drafter config key 'draft_vocab_size' must be an integer in 1..vocab_size ({vocab}), or "
                         f"absent for the target's vocabulary (got {n!r})")
    return n


def target_to_draft(d2t: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """`[vocab_size]` long: the draft id of each target token, -1 for a token outside the draft vocabulary
    (from the offsets `d2t`: target id = draft id + d2t[draft id])."""
    draft_ids = torch.arange(d2t.shape[0], device=d2t.device)
    out = torch.full((vocab_size,), -1, dtype=torch.long, device=d2t.device)
    return out.index_put_((draft_ids + d2t,), draft_ids)


@dataclass(frozen=True)
class AttentionKind:
    """How one drafter layer attends (masks are built once per forward for each distinct kind).

    Positions are absolute (the context included). A query at position q sees a key at position k when
    the layout allows it (context before the block's anchor, its own block) and, with `sliding_window` W,
    `q - k < W` (strict: distance 0..W-1 back), also `k - q < W` when not causal (a symmetric window);
    `causal` makes attention inside the block causal (k <= q). The default kind, full and non-causal, is
    DFlash's original attention: the layout alone."""

    sliding_window: Optional[int] = None
    causal: bool = False

    @property
    def is_default(self) -> bool:
        return self.sliding_window is None and not self.causal


FULL_ATTENTION = AttentionKind()
_LAYER_TYPES = ("full_attention", "sliding_attention")


def layer_kinds(config: Any) -> list[AttentionKind]:
    """Each layer's `AttentionKind`, read the reference way from the TOP LEVEL of the config: `layer_types`
    (absent: all `full_attention`), `sliding_window` (the window of the sliding layers) and `is_causal`
    (absent: causal iff the layer is sliding; set: that value for every layer)."""
    n = int(config.num_hidden_layers)
    types_ = getattr(config, "layer_types", None) or ["full_attention"] * n
    if len(types_) != n or any(t not in _LAYER_TYPES for t in types_):
        raise ValueError(f"drafter config key 'layer_types' must list {n} entries (num_hidden_layers), each one of "
                         f"{', '.join(_LAYER_TYPES)} (got {types_!r})")
    causal = getattr(config, "is_causal", None)
    if causal is not None and not isinstance(causal, bool):
        raise ValueError(f"drafter config key 'is_causal' must be true, false or absent (got {causal!r})")
    window = getattr(config, "sliding_window", None)
    if "sliding_attention" in types_ and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"drafter config key 'sliding_window' must be an integer >= 1: layer_types names "
                         f"sliding_attention layers (got {window!r})")
    kinds = []
    for t in types_:
        sliding = t == "sliding_attention"
        kinds.append(AttentionKind(window if sliding else None, sliding if causal is None else causal))
    return kinds
