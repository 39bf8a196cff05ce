"""What `target.quantize=fp8` and `drafter.fp8` need, checked before any weights load: a device and dtypes the
FP8 matmuls run with, and linear shapes `torch._scaled_mm` takes; and which target layers get quantised."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from ...architectures import reads_target_final
from ...architectures.contract import Architecture
from ...config.schema import Config
from ...errors import ConfigError
from ...accel.fp8 import SCALED_MM_MULTIPLE, require_fp8_device, unsupported_shapes
from ...accel.fp8_training import fp8_drafter_linears
from ...target.capture import target_fp8_linears
from ...target.quantize import quantized_bytes_saved

_BYTES = {torch.float32: 4, torch.bfloat16: 2, torch.float16: 2}


def fp8_target_layers(cfg: Config, layer_ids: list[int], num_layers: int, arch: Optional[Architecture] = None) -> int:
    """How many decoder layers (from the first) `target.quantize=fp8` quantises: those the captures run, up to
    the last captured layer, or every layer when the run reads the target's final hidden states (distillation, or
    an architecture that needs them: `architectures.reads_target_final`). 0: off. Every layer a capture runs is
    quantised alike: the decoder layers share one compiled forward, and a mix of FP8 and bf16 layers would
    compile a graph for each (a failed guard on the linears' type)."""
    if cfg.target.quantize != "fp8":
        return 0
    return num_layers if reads_target_final(cfg, arch) else max(layer_ids) + 1


def check_fp8_device(cfg: Config, device: torch.device, target_dtype: torch.dtype,
                     compute_dtype: torch.dtype) -> None:
    """On a GPU: FP8 tensor cores, and bfloat16 where the FP8 matmuls write (row-wise scaled `_scaled_mm` on
    CUDA writes bfloat16). The CPU runs either dtype (slowly: for tests)."""
    for key, on, dtype, dtype_key in (("target.quantize", cfg.target.quantize == "fp8", target_dtype, "target.dtype"),
                                      ("drafter.fp8", cfg.drafter.fp8, compute_dtype, "run.dtype")):
        if on:
            require_fp8_device(device, dtype, f"config key '{key}'", dtype_key, f"turn {key} off")


def _refuse_shapes(key: str, what: str, bad: list[str]) -> None:
    if bad:
        shown = ", ".join(bad[:6]) + (f" and {len(bad) - 6} more" if len(bad) > 6 else "")
        raise ConfigError(f"config key '{key}': FP8 matmuls (torch._scaled_mm on CUDA) need both dimensions of "
                          f"every {what} linear to be multiples of {SCALED_MM_MULTIPLE}; these are not: {shown}. "
                          f"Turn {key} off")


def check_fp8_shapes(cfg: Config, target_path: Path, fp8_layers: int, target_dtype: torch.dtype, dcfg,
                     arch: Optional[Architecture]) -> int:
    """Refuse linears `_scaled_mm` cannot run (before any weights load); returns the bytes that quantising the
    target saves (for the memory preflight; 0 when target.quantize is none). `arch`: the run's architecture, whose
    drafter `dcfg` describes (read with drafter.fp8 only)."""
    saved = 0
    if fp8_layers:
        linears = target_fp8_linears(target_path, cfg.target.trust_remote_code, fp8_layers)
        _refuse_shapes("target.quantize", "quantised target", unsupported_shapes(linears))
        saved = quantized_bytes_saved(linears, _BYTES[target_dtype])
    if cfg.drafter.fp8:
        with torch.device("meta"):
            drafter = arch.drafter_class(dcfg)
        _refuse_shapes("drafter.fp8", "FP8 drafter", unsupported_shapes(fp8_drafter_linears(drafter)))
    return saved
