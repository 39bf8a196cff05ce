"""The DFlash training mask: one predicate, two builders (dense boolean for sdpa, BlockMask for flex).

Layout: keys/values are `[context 0..S-1 | block_0 | ... | block_{N-1}]` (KV = S + N*B),
queries are `[block_0 ... block_{N-1}]` (Q = N*B). Query q in block n = q // B with anchor a_n
may see key k iff the block is kept and either
  - k is context strictly before the anchor: k < S and k < a_n   (`<`, never `<=`), or
  - k is in its own block: k >= S and (k - S) // B == n.
Blocks never see each other.
"""

from __future__ import annotations

import torch


def dflash_mask(
    q_idx: torch.Tensor,
    kv_idx: torch.Tensor,
    anchors: torch.Tensor,
    keep: torch.Tensor,
    context_len: int,
    block_size: int,
) -> torch.Tensor:
    """The predicate. `anchors`/`keep` are already indexed by the batch row (shape broadcastable
    against q_idx); q_idx and kv_idx broadcast against each other."""
    block = q_idx // block_size
    anchor = anchors[block]
    before_anchor = (kv_idx < context_len) & (kv_idx < anchor)
    own_block = (kv_idx >= context_len) & ((kv_idx - context_len) // block_size == block)
    return (before_anchor | own_block) & keep[block]


def dense_mask(anchors: torch.Tensor, keep: torch.Tensor, context_len: int, block_size: int) -> torch.Tensor:
    """Boolean mask `[batch, 1, N*B, S + N*B]` for sdpa, from the predicate."""
    batch, num_blocks = anchors.shape
    q_len = num_blocks * block_size
    device = anchors.device
    q_idx = torch.arange(q_len, device=device).view(q_len, 1)
    kv_idx = torch.arange(context_len + q_len, device=device).view(1, -1)
    rows = [dflash_mask(q_idx, kv_idx, anchors[b], keep[b], context_len, block_size) for b in range(batch)]
    return torch.stack(rows).unsqueeze(1)


def flex_mask_mod(anchors: torch.Tensor, keep: torch.Tensor, context_len: int, block_size: int):
    """The predicate as a flex_attention mask_mod(b, h, q_idx, kv_idx)."""

    def mask_mod(b, h, q_idx, kv_idx):
        return dflash_mask(q_idx, kv_idx, anchors[b], keep[b], context_len, block_size)

    return mask_mod


def flex_block_mask(
    anchors: torch.Tensor,
    keep: torch.Tensor,
    context_len: int,
    block_size: int,
    tile: int = 128,
):
    """A flex `BlockMask` built from tile indices computed in closed form: no dense grid is made.

    For each query tile the visible key tiles are (a) context tiles below the largest kept anchor
    of the tile, full where they lie below the smallest kept anchor, and (b) the key tiles holding
    the tile's own blocks. `mask_mod` refines the partial tiles with the exact predicate.
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

    # Per query tile: the kept blocks it holds, and their smallest / largest anchor.
    blk = torch.arange(num_blocks, device=device)
    q_tile_of = (blk * block_size) // tile  # blocks never straddle query tiles (tile % block_size == 0)
    in_tile = q_tile_of.view(1, -1) == torch.arange(n_q_tiles, device=device).view(-1, 1)  # [T, N]
    kept_in_tile = in_tile.unsqueeze(0) & keep.unsqueeze(1)  # [B, T, N]
    a = anchors.long().unsqueeze(1)
    big = torch.iinfo(torch.long).max
    max_anchor = torch.where(kept_in_tile, a, torch.zeros_like(a)).amax(-1)  # [B, T]
    min_anchor = torch.where(kept_in_tile, a, torch.full_like(a, big)).amin(-1)  # [B, T]
    # A tile is "full" only if every one of its query rows is live: all its blocks kept.
    all_kept = (kept_in_tile.sum(-1) == in_tile.sum(-1).unsqueeze(0)) & (q_len % tile == 0)

    kv_lo = torch.arange(n_kv_tiles, device=device) * tile
    kv_hi = torch.clamp(kv_lo + tile, max=kv_len)  # exclusive
    ctx_any = (kv_lo < context_len).view(1, 1, -1) & (kv_lo.view(1, 1, -1) < max_anchor.unsqueeze(-1))
    ctx_full = (kv_hi <= context_len).view(1, 1, -1) & (kv_hi.view(1, 1, -1) <= min_anchor.unsqueeze(-1))
    # Own blocks: block n's keys [S + n*bs, S + (n+1)*bs) touch at most two key tiles.
    own = torch.zeros(batch, n_q_tiles * n_kv_tiles, dtype=torch.int32, device=device)
    for first_key in (context_len + blk * block_size, context_len + (blk + 1) * block_size - 1):
        flat = (q_tile_of * n_kv_tiles + first_key // tile).expand(batch, -1)
        own.scatter_reduce_(1, flat, keep.to(torch.int32), reduce="amax")
    own_any = own.view(batch, n_q_tiles, n_kv_tiles).bool()
    visible = ctx_any | own_any
    full = ctx_full & all_kept.unsqueeze(-1) & ~own_any
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
        mask_mod=flex_mask_mod(anchors, keep, context_len, block_size),
        seq_lengths=(q_len, kv_len),
    )
