"""Attention as the drafters' forward takes it (a function of q, k, v and a mask), its dense sdpa form (decoding,
replay and CPU training), and the per-layer key/value cache of speculative decoding."""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F

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
