"""The grouped dynamic causal convolution around a block drafter's sublayers, applied inside each block of the
packed layout.

`y_t = sum_o (base[side, o] + dyn_t[side, o, group]) * x_{t-o}` for o = 0..K-1, where `x_{t-o}` is zero
when it would lie before the block's first position (a block never reads the previous block). Both sides'
taps (`side` 0 before the sublayer, 1 after it) come from one projection of the sublayer's normed input,
one tap per group of `group_size` channels. The identity start (tap 0 = 1, everything else 0)
makes an untrained layer with these convolutions compute exactly what a DFlash layer does.
"""

from __future__ import annotations

import torch
from torch import nn


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
