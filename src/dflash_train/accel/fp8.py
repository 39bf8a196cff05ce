"""FP8 (e4m3) matmuls with row-wise scales through `torch._scaled_mm`: the quantisation primitives shared by
the frozen target (`target.quantize=fp8`, `target/quantize.py`) and the drafter's FP8 training
(`drafter.fp8`, `fp8_training.py`), the shape rule `_scaled_mm` has on CUDA and the GPUs that run it.

A quantised tensor is `q * scale`: `q` float8_e4m3fn, `scale` float32 with one value per row (or per column)
of the contracted matmul operand, amax / 448 of that row. e4m3 keeps 3 mantissa bits, so each element's
relative rounding error is at most 2^-4 (a sixteenth), and row-wise scales keep one outlier row from
flattening every other row's values. Everything here is plain torch: under torch.compile inductor fuses the
amax, the division, the clamp and the cast around each `_scaled_mm` into one kernel per operand.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from ..errors import ConfigError

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
