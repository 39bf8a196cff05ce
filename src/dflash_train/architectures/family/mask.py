"""The block drafters' training mask: one predicate, two builders (dense boolean for sdpa, BlockMask for flex).

Layout: keys/values are `[context 0..S-1 | block_0 | ... | block_{N-1}]` (KV = S + N*B),
queries are `[block_0 ... block_{N-1}]` (Q = N*B). Query q in block n = q // B with anchor a_n
may see key k iff the block is kept and either
  - k is context strictly before the anchor: k < S and k < a_n   (`<`, never `<=`), or
  - k is in its own block: k >= S and (k - S) // B == n.
Blocks never see each other. A layer's `AttentionKind` narrows this (the reference's semantics), in
absolute positions: query slot i sits at position a_n + i, a context key at its index k, own-block slot j at
a_n + j.
  - `causal`: inside the block, slot i sees slots j <= i only.
  - `sliding_window` W: the query sees keys with q_pos - k_pos < W (strict), and also k_pos - q_pos < W when
    not causal. So slot i sees the context positions a_n + i - W + 1 .. a_n - 1 (W - 1 - i of them once
    the context is long enough); inside the block the window cuts only when W < B. Every query always sees
    itself, so no kept row is ever empty.
Decoding with a KV cache is this layout with one block anchored at the end of the context (a = S).
"""

from __future__ import annotations

from typing import Optional

import torch


def dflash_mask(
    q_idx: torch.Tensor,
    kv_idx: torch.Tensor,
    anchors: torch.Tensor,
    keep: torch.Tensor,
    context_len: int,
    block_size: int,
    window: Optional[int] = None,
    causal: bool = False,
) -> torch.Tensor:
    """The predicate. `anchors`/`keep` are already indexed by the batch row (shape broadcastable
    against q_idx); q_idx and kv_idx broadcast against each other. `window`/`causal`: the layer's kind."""
    block = q_idx // block_size
    anchor = anchors[block]
    is_context = kv_idx < context_len
    before_anchor = is_context & (kv_idx < anchor)
    own_block = ~is_context & ((kv_idx - context_len) // block_size == block)
    if causal or window is not None:
        slot = q_idx - block * block_size  # the query's slot i
        key_slot = kv_idx - context_len - block * block_size  # slot j of an own-block key
        if causal:
            own_block = own_block & (key_slot <= slot)
        if window is not None:
            # q_pos - k_pos: (a + i) - k for context keys, i - j for own-block keys.
            back = torch.where(is_context, anchor + slot - kv_idx, slot - key_slot)
            near = back < window
            if not causal:
                near = near & (-back < window)
            before_anchor, own_block = before_anchor & near, own_block & near
    return (before_anchor | own_block) & keep[block]


def dense_mask(anchors: torch.Tensor, keep: torch.Tensor, context_len: int, block_size: int,
               window: Optional[int] = None, causal: bool = False) -> torch.Tensor:
    """Boolean mask `[batch, 1, N*B, S + N*B]` for sdpa, from the predicate."""
    batch, num_blocks = anchors.shape
    q_len = num_blocks * block_size
    device = anchors.device
    q_idx = torch.arange(q_len, device=device).view(q_len, 1)
    kv_idx = torch.arange(context_len + q_len, device=device).view(1, -1)
    rows = [dflash_mask(q_idx, kv_idx, anchors[b], keep[b], context_len, block_size, window, causal)
            for b in range(batch)]
    return torch.stack(rows).unsqueeze(1)


def flex_mask_mod(anchors: torch.Tensor, keep: torch.Tensor, context_len: int, block_size: int,
                  window: Optional[int] = None, causal: bool = False):
    """The predicate as a flex_attention mask_mod(b, h, q_idx, kv_idx)."""

    def mask_mod(b, h, q_idx, kv_idx):
        return dflash_mask(q_idx, kv_idx, anchors[b], keep[b], context_len, block_size, window, causal)

    return mask_mod


def flex_block_mask(
    anchors: torch.Tensor,
    keep: torch.Tensor,
    context_len: int,
    block_size: int,
    tile: int = 128,
    window: Optional[int] = None,
    causal: bool = False,
):
    """A flex `BlockMask` built from tile indices computed in closed form: no dense grid is made.

    Block n (kept) sees the context interval [a_n - W + 1, a_n) at its slot 0 and sub-intervals of it at its
    other slots (no window: [0, a_n) at every slot). For each query tile the visible key tiles are (a) the
    context tiles some of its kept blocks' intervals touch, "full" where every slot of every block of the
    tile sees the whole tile (the tile lies in [a_n + B - W, a_n) for each block, every block kept), and
    (b) the key tiles holding the tile's own blocks, always partial. `mask_mod` refines the partial tiles
    with the exact predicate.
    """
    from torch.nn.attention.flex_attention import BlockMask

    batch, num_blocks = anchors.shape
    device = anchors.device
    q_len = num_blocks * block_size
    kv_len = context_len + q_len
    n_q_tiles = -(-q_len // tile)
    n_kv_tiles = -(-kv_len // tile)
    if tile % block_size:
        raise ValueError(f"flex tile {tile} must be a multiple of block_size {block_size}")

    # Blocks never straddle query tiles (tile % block_size == 0): pad the blocks to whole tiles (not kept)
    # and view them per tile: [B, tiles * per_tile, 1] against the key tiles.
    per_tile = tile // block_size
    pad = n_q_tiles * per_tile - num_blocks
    a = torch.nn.functional.pad(anchors.long(), (0, pad)).unsqueeze(-1)
    kept = torch.nn.functional.pad(keep, (0, pad)).unsqueeze(-1)

    kv_lo = torch.arange(n_kv_tiles, device=device) * tile
    kv_hi = torch.clamp(kv_lo + tile, max=kv_len)  # exclusive
    ctx_hi = torch.clamp(kv_hi, max=context_len)  # context keys of the tile end here
    has_ctx = kv_lo < context_len
    lowest = a - window + 1 if window is not None else torch.zeros_like(a)  # slot 0's first visible key
    # [lowest, a) meets the tile's context keys [kv_lo, ctx_hi) (empty when W = 1: a query sees itself only)
    touches = kept & has_ctx & (kv_lo < a) & (ctx_hi > lowest) & (lowest < a)  # [B, T*per_tile, KV tiles]
    # Every slot i sees [a + i - W + 1, a): the last slot's interval is the narrowest.
    narrowest = a + block_size - window if window is not None else torch.zeros_like(a)
    covers = (kv_hi <= context_len) & (kv_hi <= a) & (kv_lo >= narrowest)
    covers = kept & covers  # a tile with a padding block (the last, when q_len % tile) is never full
    ctx_any = touches.view(batch, n_q_tiles, per_tile, n_kv_tiles).any(2)
    ctx_full = covers.view(batch, n_q_tiles, per_tile, n_kv_tiles).all(2)

    # Own blocks: block n's keys [S + n*bs, S + (n+1)*bs) touch at most two key tiles.
    blk = torch.arange(num_blocks, device=device)
    q_tile_of = (blk * block_size) // tile
    own = torch.zeros(batch, n_q_tiles * n_kv_tiles, dtype=torch.int32, device=device)
    for first_key in (context_len + blk * block_size, context_len + (blk + 1) * block_size - 1):
        flat = (q_tile_of * n_kv_tiles + first_key // tile).expand(batch, -1)
        own.scatter_reduce_(1, flat, keep.to(torch.int32), reduce="amax")
    own_any = own.view(batch, n_q_tiles, n_kv_tiles).bool()
    visible = ctx_any | own_any
    full = ctx_full & ctx_any & ~own_any
    partial = visible & ~full

    def to_indices(sel: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        counts = sel.sum(-1).to(torch.int32)  # [B, T]
        # Stable sort puts selected tiles first, in ascending order.
        order = torch.argsort((~sel).to(torch.int8), dim=-1, stable=True).to(torch.int32)
        return counts.unsqueeze(1), order.unsqueeze(1)  # add the head dim (H = 1, broadcast)

    kv_num, kv_idx = to_indices(partial)
    full_num, full_idx = to_indices(full)
    return BlockMask.from_kv_blocks(
        kv_num,
        kv_idx,
        full_num,
        full_idx,
        BLOCK_SIZE=tile,
        mask_mod=flex_mask_mod(anchors, keep, context_len, block_size, window, causal),
        seq_lengths=(q_len, kv_len),
    )
