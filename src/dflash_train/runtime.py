"""What every command shares at run time: the device and dtype it computes in. (Files and folders are written
by files/io.py.)

torch is imported inside the functions that need it: a command that loads no model imports this module without
it (importing torch alone takes 1.7 s, measured on the 2-core CPU machine).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

DTYPE_NAMES = ("bfloat16", "float16", "float32")


# ---------------------------------------------------------------------------------- device, dtype


def resolve_device(name: str) -> torch.device:
    """`auto`: cuda when a GPU is visible, else cpu; `cuda` without a visible GPU is refused."""
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        from .errors import UserError

        raise UserError("device cuda (run.device / --device) but no CUDA device is visible; use cpu or auto")
    return torch.device(name)


def dtype_named(name: str) -> torch.dtype:
    import torch

    if name not in DTYPE_NAMES:
        raise ValueError(f"unknown dtype {name!r}; expected one of {', '.join(DTYPE_NAMES)}")
    return getattr(torch, name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """`auto`: bfloat16 on a GPU, float32 on the CPU; else the dtype of that name."""
    import torch

    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return dtype_named(name)


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A copy that does not wait for the device: a CPU tensor goes to a GPU from pinned memory (CUDA copies
    from pageable memory synchronise the stream first)."""
    if t.device.type == "cpu" and device.type == "cuda":
        t = t.pin_memory()
    return t.to(device, non_blocking=True)
