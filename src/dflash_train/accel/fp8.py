"""FP8 (e4m3) matmuls with row-wise scales through `torch._scaled_mm`: the quantisation primitives shared by
the frozen target (`target.quantize=fp8`, this module's `Fp8Linear`) and the drafter's FP8 training
(`drafter.fp8`, `fp8_training.py`), the shape rule `_scaled_mm` has on CUDA and the GPUs that run it.

A quantised tensor is `q * scale`: `q` float8_e4m3fn, `scale` float32 with one value per row (or per column)
of the contracted matmul operand, amax / 448 of that row. e4m3 keeps 3 mantissa bits, so each element's
relative rounding error is at most 2^-4 (a sixteenth), and row-wise scales keep one outlier row from
flattening every other row's values. Everything here is plain torch: under torch.compile inductor fuses the
amax, the division, the clamp and the cast around each `_scaled_mm` into one kernel per operand.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Iterable, Optional

import torch
from torch import nn

from ..errors import ConfigError, ModelError

log = logging.getLogger(__name__)

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
# An all-zero row gets a tiny positive scale (its values quantise to 0) instead of a 0 (0 / 0 = NaN).
AMAX_FLOOR = 1e-12
# torch._scaled_mm on CUDA (cuBLASLt's FP8 GEMM) refuses operands whose contracted or output dimension is not
# a multiple of 16 (the token dimension M may be anything).
SCALED_MM_MULTIPLE = 16
# FP8 tensor-core matmuls: Ada (8.9), Hopper (9.0) and later.
FP8_COMPUTE_CAPABILITY = (8, 9)


def scales(x: torch.Tensor, dim: int = -1, power_of_2: bool = False) -> torch.Tensor:
    """float32 scales of `x` along `dim` (kept as a size-1 dimension): amax / 448, so the largest magnitude maps
    to e4m3's largest value. `power_of_2`: rounded up to a power of two (torchao's row-wise training recipe), so
    that dividing by it changes only the exponent."""
    amax = x.abs().amax(dim=dim, keepdim=True).float().clamp(min=AMAX_FLOOR)
    scale = amax / FP8_MAX
    if power_of_2:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    return scale


def quantize(x: torch.Tensor, dim: int = -1, power_of_2: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(`q` float8_e4m3fn of `x`'s shape, float32 scales with `dim` of size 1): `x ~= q * scale`. The clamp
    keeps rounding in `x / scale` from passing 448 (a cast beyond e4m3's range gives NaN, not a saturation)."""
    scale = scales(x, dim, power_of_2)
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (q.to(torch.float32) * scale).to(dtype)


def scaled_mm(a_q: torch.Tensor, a_scale: torch.Tensor, b_q: torch.Tensor, b_scale: torch.Tensor,
              out_dtype: torch.dtype) -> torch.Tensor:
    """`(a_q * a_scale) @ (b_q * b_scale)` in `out_dtype`: `a_q [M, K]` row-major with `a_scale [M, 1]`, `b_q
    [K, N]` column-major (the transpose of a contiguous `[N, K]`) with `b_scale [1, N]`: the layouts and
    scale shapes the CUDA kernel takes for row-wise scaling."""
    return torch._scaled_mm(a_q, b_q, scale_a=a_scale, scale_b=b_scale, out_dtype=out_dtype)


def unsupported_shapes(linears: Iterable[tuple[str, nn.Module]]) -> list[str]:
    """`name [out, in]` of each linear whose weight `_scaled_mm` refuses on CUDA (a dimension not a multiple
    of 16)."""
    bad = []
    for name, m in linears:
        n, k = m.out_features, m.in_features
        if n % SCALED_MM_MULTIPLE or k % SCALED_MM_MULTIPLE:
            bad.append(f"{name} [{n}, {k}]")
    return bad


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


def require_fp8_device(device: torch.device, dtype: torch.dtype, what: str, dtype_key: str, off: str) -> None:
    """ConfigError `what: ...` unless `device` runs FP8 matmuls writing `dtype` (any on the CPU)."""
    if device.type != "cuda":
        return
    capability = torch.cuda.get_device_capability(device)
    if capability < FP8_COMPUTE_CAPABILITY:
        raise ConfigError(f"{what}: FP8 matmuls need a GPU of compute capability 8.9 or later (Ada, Hopper, "
                          f"Blackwell); this one is {capability[0]}.{capability[1]}. {off[0].upper()}{off[1:]}")
    if dtype != torch.bfloat16:
        raise ConfigError(f"{what}: on a GPU the FP8 matmuls (torch._scaled_mm, row-wise scales) write bfloat16, so "
                          f"{dtype_key} must be bfloat16 or auto (it is {str(dtype).removeprefix('torch.')}); or {off}")


def named_linears(module: nn.Module, prefix: str = "") -> list[tuple[str, nn.Linear]]:
    return [(f"{prefix}{name}", m) for name, m in module.named_modules() if isinstance(m, nn.Linear)]


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
