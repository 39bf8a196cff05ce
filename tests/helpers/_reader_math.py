"""The two pieces of Qwen3 layer math the independent export readers share, written from the published formulas
(not from our model code): RMSNorm and the rotary embedding (half-split), over a reader's `eps` and `inv_freq`."""

import torch


class ReaderMath:
    eps: float
    inv_freq: torch.Tensor

    def rms(self, x, w):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))

    def rope(self, x, pos):
        f = pos.float()[:, None] * self.inv_freq
        cos, sin = torch.cat([f, f], -1).cos(), torch.cat([f, f], -1).sin()
        x1, x2 = x.chunk(2, -1)
        return x * cos + torch.cat([-x2, x1], -1) * sin
