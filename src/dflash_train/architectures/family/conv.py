"""The grouped dynamic causal convolution around a block drafter's sublayers, applied inside each block of the
packed layout (`BlockConv`), and the decoder layer that wraps each attention and MLP sublayer in it
(`ConvDecoderLayer`, the layers of the members that take the convolution).

`y_t = sum_o (base[side, o] + dyn_t[side, o, group]) * x_{t-o}` for o = 0..K-1, where `x_{t-o}` is zero
when it would lie before the block's first position (a block never reads the previous block). Both sides'
taps (`side` 0 before the sublayer, 1 after it) come from one projection of the sublayer's normed input,
one tap per group of `group_size` channels. The identity start (tap 0 = 1, everything else 0)
makes an untrained layer with these convolutions compute exactly what a DFlash layer does.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import Qwen3Config

from .layers import BlockDecoderLayer, RopeTables

# The `dflash_config` fields of a drafter whose layers carry the convolutions (the engines build them from these).
CONV_FIELDS = ("conv_kernel_size", "conv_group_size")


class BlockConv(nn.Module):
    def __init__(self, hidden_size: int, kernel_size: int, group_size: int):
        super().__init__()
        if hidden_size % group_size:
            raise ValueError(f"the convolution's group size {group_size} must divide the hidden size {hidden_size}")
        if kernel_size < 1:
            raise ValueError(f"the convolution's kernel size must be >= 1 (got {kernel_size})")
        self.kernel_size, self.group_size = kernel_size, group_size
        self.groups = hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.empty(2, kernel_size, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * self.groups, bias=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        self.base_kernel.zero_()
        self.base_kernel[:, 0] = 1.0
        self.kernel_projection.weight.zero_()

    def taps(self, normed: torch.Tensor) -> torch.Tensor:
        """The dynamic taps `[b, Q, 2, K, G]` predicted from the sublayer's normed input `[b, Q, H]`."""
        b, q, _ = normed.shape
        return self.kernel_projection(normed).view(b, q, 2, self.kernel_size, self.groups)

    def forward(self, x: torch.Tensor, taps: torch.Tensor, side: int, block_len: int) -> torch.Tensor:
        """`x [b, Q, H]`, Q a whole number of blocks of `block_len`; `taps` from `taps()`; side 0 (before the
        sublayer) or 1 (after it). The block boundary is a mask on the position within its block, not a view
        into `[blocks, block_len]`: with the length dynamic under torch.compile, `Q // block_len` in every
        index made inductor's backward several times slower to compile (and to guard)."""
        b, q, h = x.shape
        xg = x.view(b, q, self.groups, self.group_size)
        dyn = taps[:, :, side].unsqueeze(-1)  # [b, Q, K, G, 1]
        base = self.base_kernel[side].view(self.kernel_size, self.groups, self.group_size).to(x.dtype)
        out = xg * (base[0] + dyn[:, :, 0]).to(x.dtype)
        if self.kernel_size > 1 and block_len > 1:
            offset = torch.arange(q, device=x.device) % block_len  # each position's place in its block
        for o in range(1, min(self.kernel_size, block_len)):
            shifted = torch.nn.functional.pad(xg[:, : q - o], (0, 0, 0, 0, o, 0))
            inside = (offset >= o).view(1, q, 1, 1)  # x_{t-o} lies in t's block
            out = out + torch.where(inside, shifted, 0) * (base[o] + dyn[:, :, o]).to(x.dtype)
        return out.view(b, q, h)


def has_conv_layers(dflash_config: dict) -> bool:
    """Whether a drafter config's layers carry the block convolutions (its `dflash_config` has `CONV_FIELDS`)."""
    return all(k in dflash_config for k in CONV_FIELDS)


class ConvDecoderLayer(BlockDecoderLayer):
    """The family's decoder layer with a `BlockConv` before and after its attention and its MLP sublayer; the
    parameter names are the engines' (`layers.{i}.attention_conv.base_kernel`, `layers.{i}.mlp_conv...`)."""

    def __init__(self, config: Qwen3Config):
        super().__init__(config)
        d = config.dflash_config
        self.block_size = int(config.block_size)
        shape = (config.hidden_size, int(d["conv_kernel_size"]), int(d["conv_group_size"]))
        self.attention_conv = BlockConv(*shape)
        self.mlp_conv = BlockConv(*shape)

    def attention_inputs(self, x: torch.Tensor, context: torch.Tensor, rope: RopeTables, block_len: int):
        normed = self.input_layernorm(x)
        taps = self.attention_conv.taps(normed)  # both sides' taps, from the normed input
        mixed = self.attention_conv(normed, taps, 0, block_len)
        return (*self.self_attn.project(mixed, context, rope), taps)

    def attention_output_and_mlp(self, x: torch.Tensor, attn: torch.Tensor, taps: torch.Tensor,
                                 block_len: int) -> torch.Tensor:
        x = x + self.attention_conv(self.self_attn.output(attn), taps, 1, block_len)
        normed = self.post_attention_layernorm(x)
        mlp_taps = self.mlp_conv.taps(normed)
        return x + self.mlp_conv(self.mlp(self.mlp_conv(normed, mlp_taps, 0, block_len)), mlp_taps, 1, block_len)

    def forward(self, x, context, rope, attention, mask, cache=None, layer_idx=0, parts=None) -> torch.Tensor:
        """As `BlockDecoderLayer.forward`; the convolutions need the block length: the trained block size in
        the packed training layout, and the whole query (one block, possibly a shorter one) when decoding."""
        inputs, output = parts or (type(self).attention_inputs, type(self).attention_output_and_mlp)
        block_len = x.shape[1] if cache is not None else self.block_size
        q, k_ctx, v_ctx, k_blk, v_blk, taps = inputs(self, x, context, rope, block_len)
        k, v = torch.cat([k_ctx, k_blk], dim=2), torch.cat([v_ctx, v_blk], dim=2)
        if cache is not None:
            k, v = cache.append(layer_idx, k, v)
        return output(self, x, attention(q, k, v, mask), taps, block_len)


def reset_convs(module: nn.Module) -> None:
    """Every `BlockConv` under `module` back to its identity start (after a blanket init of every Linear)."""
    for m in module.modules():
        if isinstance(m, BlockConv):
            m.reset_parameters()


def conv_values_per_query(kernel_size: int, hidden: int) -> int:
    """Activation values a `ConvDecoderLayer`'s four convolutions keep to the backward per query token: each its
    K - 1 masked shifted inputs (H each), and the two before a sublayer their output, which the sublayer's
    projections read (2 H)."""
    return (4 * (kernel_size - 1) + 2) * hidden


def conv_flops_per_query(kernel_size: int, group_size: int, hidden: int) -> float:
    """Model FLOPs (forward + backward) of a `ConvDecoderLayer`'s two tap projections (H -> 2 K H / group) per query
    token; the taps' elementwise products are not counted, as nowhere else."""
    return 3.0 * 2 * 2 * hidden * (2 * kernel_size * hidden // group_size)
