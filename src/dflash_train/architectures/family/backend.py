"""Attention backends for the drafter's training layout. The choice is explicit and logged.

- `sdpa`: a dense boolean mask from the predicate (CPU and small inputs).
- `flex`: compiled flex_attention with a BlockMask built in closed form (GPU). FlexAttention has
  no CPU backward, so `flex` on CPU is refused rather than run slowly or densely.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import torch

from ..attention import AttentionFn, sdpa_attention
from .mask import dense_mask, flex_block_mask
from .reference_fields import FULL_ATTENTION, AttentionKind

log = logging.getLogger(__name__)

FLEX_TILE = 128


def compiled_flex_attention(dynamic: bool = True) -> Callable:
    """The process's compiled flex_attention (compile layer: one lock, fullgraph). Training uses
    dynamic shapes (sequence and block counts change every batch); inductor's CPU backend cannot
    compile flex with dynamic shapes, so CPU checks use `dynamic=False`."""
    from torch.nn.attention.flex_attention import flex_attention

    from ...accel.compile import compiled

    name = "flex_attention" if dynamic else "flex_attention_static"
    return compiled(name, flex_attention, dynamic=dynamic)


@dataclass
class AttentionBackend:
    name: str
    attention: AttentionFn
    # Number of blocks must be a multiple of this (flex tiles whole query blocks).
    blocks_multiple_of: int
    # The context (target positions) is padded to a multiple of this: with query and key lengths whole
    # tiles, flex runs its kernels without bounds checks (under dynamic shapes it cannot prove that itself).
    context_multiple_of: int = 1

    def build_mask(self, anchors: torch.Tensor, keep: torch.Tensor, context_len: int, block_size: int,
                   kind: AttentionKind = FULL_ATTENTION) -> object:
        """The mask of layers of `kind` (`drafter.layer_masks(lambda kind: backend.build_mask(..., kind))`
        builds one per kind)."""
        if self.name == "flex":
            return flex_block_mask(anchors, keep, context_len, block_size, tile=FLEX_TILE,
                                   window=kind.sliding_window, causal=kind.causal)
        return dense_mask(anchors, keep, context_len, block_size, kind.sliding_window, kind.causal)


def resolve_backend(requested: str, device: torch.device, block_size: int, training: bool = True) -> AttentionBackend:
    name = requested
    if name == "auto":
        name = "flex" if device.type == "cuda" else "sdpa"
    if name == "flex" and device.type != "cuda" and training:
        raise ValueError(
            "drafter.attention_backend=flex needs a CUDA device for training (FlexAttention has no CPU backward); "
            "use drafter.attention_backend=sdpa on CPU"
        )
    if name == "flex":
        if FLEX_TILE % block_size:
            raise ValueError(f"flex backend needs block_size to divide {FLEX_TILE} (got {block_size}); use sdpa")
        flex = compiled_flex_attention()
        divisible = {"IS_DIVISIBLE": True}

        def attention(q, k, v, mask):
            if q.shape[2] % FLEX_TILE or k.shape[2] % FLEX_TILE:
                raise ValueError(f"flex attention: query and key lengths must be multiples of {FLEX_TILE} (got "
                                 f"{q.shape[2]} and {k.shape[2]}); the objective pads the context to "
                                 f"backend.context_multiple_of and sample_anchors rounds the blocks")
            return flex(q, k, v, block_mask=mask, enable_gqa=q.shape[1] != k.shape[1], kernel_options=divisible)

        multiple = max(FLEX_TILE // block_size, 1)
        backend = AttentionBackend("flex", attention, multiple, FLEX_TILE)
    else:
        backend = AttentionBackend("sdpa", sdpa_attention, 1)
    log.info("drafter attention backend: %s (requested %s, device %s)", backend.name, requested, device)
    return backend
