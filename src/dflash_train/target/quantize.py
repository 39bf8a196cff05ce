"""The frozen target's FP8 quantisation (`target.quantize=fp8`): `Fp8Linear`, a linear layer whose weight is
quantised once per output channel, and `quantize_decoder_layers`, which puts it in place of every `nn.Linear` of
the first decoder layers; built on the primitives of `accel/fp8.py`."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Iterable, Optional

import torch
from torch import nn

from ..accel.fp8 import SCALED_MM_MULTIPLE, named_linears, quantize, scaled_mm, unsupported_shapes
from ..errors import ModelError

log = logging.getLogger(__name__)


class Fp8Linear(nn.Module):
    """A frozen linear layer in FP8: the weight quantised once per output channel (`weight_fp8 [out, in]`,
    `weight_scale [1, out]`), each input row (token) quantised on the fly over its features, one `_scaled_mm`
    into the input's dtype. The weight is not called `weight`, so code that reads a linear's `.weight` (to
    cast to its dtype, say) fails loudly instead of computing with FP8 values."""

    def __init__(self, weight_fp8: torch.Tensor, weight_scale: torch.Tensor, bias: Optional[torch.Tensor]):
        super().__init__()
        self.out_features, self.in_features = weight_fp8.shape
        self.register_buffer("weight_fp8", weight_fp8)
        self.register_buffer("weight_scale", weight_scale)
        self.register_buffer("bias", bias)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "Fp8Linear":
        weight = linear.weight.detach()
        q, scale = quantize(weight, dim=1)  # per output channel: [out, 1]
        bias = None if linear.bias is None else linear.bias.detach().clone()
        return cls(q, scale.reshape(1, -1).contiguous(), bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x_q, x_scale = quantize(x.reshape(-1, self.in_features))  # per token: [M, 1]
        out = scaled_mm(x_q, x_scale, self.weight_fp8.t(), self.weight_scale, x.dtype)
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, fp8"


@dataclass
class QuantizedLayers:
    """What `quantize_decoder_layers` did: the linears now in FP8 and the matrices of those layers left as they
    were (not `nn.Linear`, e.g. a mixture-of-experts' fused expert tensors), each `name [shape]`."""

    quantized: list[str]
    left_high_precision: list[str]


def _replace(root: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(root.get_submodule(parent_name) if parent_name else root, child, new)


def quantize_decoder_layers(layers: nn.ModuleList, count: int, device: torch.device) -> QuantizedLayers:
    """Quantise every `nn.Linear` of `layers[:count]` to `Fp8Linear`, one layer at a time: each layer moves to
    `device` and its high-precision weights are dropped before the next, so the device never holds more than
    one layer's of them. Raises if a linear's shape is one `_scaled_mm` refuses (admission checks this before
    any weights load; this is the guard for other callers)."""
    quantized, left = [], []
    for i in range(count):
        layer = layers[i].to(device)
        linears = named_linears(layer)
        bad = unsupported_shapes((f"layers.{i}.{name}", m) for name, m in linears)
        if bad:
            raise ModelError(f"FP8 (torch._scaled_mm) needs linear dimensions that are multiples of "
                             f"{SCALED_MM_MULTIPLE}; these are not: {', '.join(bad)}")
        for name, linear in linears:
            _replace(layer, name, Fp8Linear.from_linear(linear))
            quantized.append(f"layers.{i}.{name}")
        left += [(f"layers.{i}.{n} {list(p.shape)}", p.dtype) for n, p in layer.named_parameters() if p.ndim >= 2]
    if left:
        log.warning("target.quantize=fp8: %d matrices of the quantised layers are not nn.Linear and stay in %s: %s",
                    len(left), left[0][1], ", ".join(n for n, _ in left[:8]) + (" ..." if len(left) > 8 else ""))
    return QuantizedLayers(quantized, [n for n, _ in left])


def quantized_bytes_saved(linears: Iterable[tuple[str, nn.Module]], element_bytes: int) -> int:
    """Bytes that quantising these linears saves against `element_bytes` per weight: each weight becomes one
    byte, plus one float32 scale per output channel."""
    saved = 0
    for _, m in linears:
        saved += m.out_features * m.in_features * (element_bytes - 1) - 4 * m.out_features
    return saved
