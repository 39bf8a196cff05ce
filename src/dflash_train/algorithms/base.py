"""What the generic stack (trainer, validation, evaluation, export) needs from a drafter architecture.

An architecture is a package under `algorithms/` that provides an `Architecture`: its drafter class, how
to derive the drafter's config from the target's and read it back from an exported config.json, the
reference-format config it exports, its attention backend, and its training objective. The generic code
never imports an architecture's package; it asks the registry (`algorithms.architecture(name)`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional, Protocol

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from ..config import Config
    from ..data.batch import Batch


@dataclass
class StepStats:
    """Sums over a micro-batch or a step (tensors on the device: read them only when logging)."""

    loss: torch.Tensor
    correct_per_slot: torch.Tensor  # [bs] counted slots predicted right
    counted_per_slot: torch.Tensor  # [bs] counted slots
    accepted_sum: torch.Tensor  # sum over kept blocks of the acceptance-length estimate
    kept_blocks: torch.Tensor
    grad_norm: torch.Tensor | None = None

    @staticmethod
    def sum(parts: "list[StepStats]") -> "StepStats":
        """Counts add up over micro-batches; the loss is their mean."""
        return StepStats(
            loss=torch.stack([p.loss for p in parts]).mean(),
            correct_per_slot=sum(p.correct_per_slot for p in parts),
            counted_per_slot=sum(p.counted_per_slot for p in parts),
            accepted_sum=sum(p.accepted_sum for p in parts),
            kept_blocks=sum(p.kept_blocks for p in parts),
        )


def acceptance_estimate(correct: torch.Tensor) -> torch.Tensor:
    """`[..., bs]` correctness of slots 1..bs-1 (slot 0 ignored) -> `1 + leading run of correct slots`."""
    return 1 + correct[..., 1:].long().cumprod(-1).sum(-1)


def default_target_layer_ids(num_target_layers: int, num_ids: int) -> list[int]:
    """The reference rule: one id -> the middle layer; else evenly from layer 1 to L - 3."""
    if num_ids == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    return [int(round(start + i * (end - start) / (num_ids - 1))) for i in range(num_ids)]


# An attention function: (q [b, nh, Q, d], k [b, nkv, KV, d], v, mask) -> [b, nh, Q, d].
AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, object], torch.Tensor]


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
    """Dense attention with an optional boolean mask `[b, 1, Q, KV]`; rows with no visible key give 0."""
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=q.shape[1] != k.shape[1])
    # A row with no visible key (a not-kept block) is NaN in some kernels, and NaN poisons the
    # backward. Let such rows see every key, then zero their output: no gradient flows through them.
    dead = ~mask.any(-1, keepdim=True)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask | dead, enable_gqa=q.shape[1] != k.shape[1])
    return out.masked_fill(dead, 0.0)


class DrafterKVCache:
    """Per-layer key/value cache for speculative decoding; `crop` drops rejected positions."""

    def __init__(self, num_layers: int):
        self.keys: list[Optional[torch.Tensor]] = [None] * num_layers
        self.values: list[Optional[torch.Tensor]] = [None] * num_layers

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.keys[layer] is not None:
            k = torch.cat([self.keys[layer], k], dim=2)
            v = torch.cat([self.values[layer], v], dim=2)
        self.keys[layer], self.values[layer] = k, v
        return k, v

    def length(self) -> int:
        return 0 if self.keys[0] is None else self.keys[0].shape[2]

    def crop(self, length: int) -> None:
        for i, k in enumerate(self.keys):
            if k is not None:
                self.keys[i] = k[:, :, :length]
                self.values[i] = self.values[i][:, :, :length]


class Drafter(nn.Module):
    """The attributes generic code reads off any architecture's drafter (set by its constructor):
    `config` (the exported config), `block_size`, `mask_token_id`, `target_layer_ids`, `layers` (for a KV
    cache per layer) and `layers_compiled`. Its forward maps (target features `[b, S, K*H]`, block
    embeddings `[b, Q, H]`, position ids `[b, S + Q]`, attention fn, mask[, cache]) to the block's final
    hidden states `[b, Q, H]`; `logits` turns those into the vocabulary scores decoding ranks."""

    architecture: str  # its `drafter.architecture` name (the registry's key)
    config: Any
    block_size: int
    mask_token_id: int
    target_layer_ids: list[int]
    layers: nn.ModuleList

    @property
    def layers_compiled(self) -> bool:
        return False

    def dense_mask(self, anchors: torch.Tensor, keep: torch.Tensor, context_len: int) -> torch.Tensor:
        """The training layout's boolean mask `[b, 1, N*bs, S + N*bs]` for blocks at `anchors` `[b, N]`."""
        raise NotImplementedError

    def logits(self, hidden: torch.Tensor, lm_head: nn.Module) -> torch.Tensor:
        """Vocabulary scores of the block's final hidden states, through the target's lm_head."""
        return lm_head(hidden.to(lm_head.weight.dtype))

    def draft(self, hidden: torch.Tensor, lm_head: nn.Module, anchor_ids: torch.Tensor, temperature: float = 0.0,
              generator: Optional[torch.Generator] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The drafts `[n, bs-1]` for slots 1.. of `n` blocks, from their final hidden states `[n, bs, H]` (slot 0
        is the anchor, `anchor_ids [n]`): the argmax of each slot, or with `temperature > 0` a sample from
        `q = softmax(logits / temperature)`, returned too (`[n, bs-1, V]`) for speculative sampling. Every row
        goes through the lm_head and the anchor's is dropped (on CPU a 15-row product with a large lm_head
        costs twice a 16-row one)."""
        logits = self.logits(hidden, lm_head)[:, 1:].float()
        if temperature <= 0:
            return logits.argmax(-1), None
        q = torch.softmax(logits / temperature, -1)
        drafts = torch.multinomial(q.reshape(-1, q.shape[-1]), 1, generator=generator).view(q.shape[:-1])
        return drafts, q

    def tree_candidates(self, hidden: torch.Tensor, lm_head: nn.Module, anchor_ids: torch.Tensor,
                        k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Each slot's `k` best next tokens and their log-probabilities, best first (`[n, bs-1, k]` each), for a
        DDTree over the block: here the slots' own distributions."""
        log_probs = torch.log_softmax(self.logits(hidden, lm_head)[:, 1:].float(), -1)
        return log_probs.topk(min(k, log_probs.shape[-1]), dim=-1)


class Objective(Protocol):
    """An architecture's training objective on one micro-batch, graph kept for backward. `generator` draws
    the anchors; `call` runs the drafter's forward (its DDP wrapper on several ranks); `hidden` is the
    target's capture when another rank computed it."""

    def __call__(self, batch: "Batch", generator: torch.Generator, call: Optional[Callable] = None,
                 hidden: Optional[torch.Tensor] = None) -> StepStats: ...


@dataclass(frozen=True)
class Architecture:
    name: str  # the `drafter.architecture` value
    hf_architecture: str  # `architectures[0]` of its exported config.json
    drafter_class: Callable[["PretrainedConfig"], Drafter]
    # (target config, the run's `drafter` config section, target layer ids, mask token id) -> drafter config
    config_for_run: Callable[..., "PretrainedConfig"]
    config_from_dict: Callable[[dict], "PretrainedConfig"]  # an exported config.json -> drafter config
    config_json: Callable[[Drafter, str], dict]  # (drafter, dtype name) -> the config.json it exports
    resolve_backend: Callable[..., Any]  # (requested, device, block_size, training) -> attention backend
    objective: Callable[[Drafter, Any, Any, "Config", torch.dtype], Objective]  # (drafter, target, backend, cfg, dtype)
