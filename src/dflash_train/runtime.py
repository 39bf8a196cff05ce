"""What every command shares at run time: the device and dtype it computes in, and writes that a reader (or a
kill) never sees half done.

torch is imported inside the functions that need it: `dflash-train status` and
`stop` import this module (through run/) and start in 0.1 s, and importing torch alone takes 1.7 s
(measured on the 2-core CPU machine).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

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


# --------------------------------------------------------------------------------- atomic writes


def write_text_atomic(path: Path, text: str) -> None:
    """Write through a temp file and a rename: a reader (or a kill) never sees half a file."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{threading.get_ident()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def write_json_atomic(path: Path, data: Any) -> None:
    write_text_atomic(path, json.dumps(data, indent=2, sort_keys=True))


def read_json_file(path: Path, remedy: str) -> Any:
    """The JSON value in `path`; an empty, cut or garbled file raises DamagedFileError naming it and `remedy`."""
    from .errors import DamagedFileError

    path = Path(path)
    data = path.read_bytes()
    try:
        return json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as e:
        problem = f"not UTF-8 text: invalid byte at offset {e.start}"
    except json.JSONDecodeError as e:
        problem = "empty" if not data.strip() else f"not valid JSON: {e.msg} at line {e.lineno} column {e.colno}"
    except RecursionError:
        problem = "not valid JSON: nested too deeply"
    raise DamagedFileError(path, problem, remedy, size=len(data))


def publish(tmp: Path, final: Path) -> None:
    """Move a finished temp file (or folder, onto a missing or empty one) to `final` in one rename."""
    os.replace(tmp, final)


def temp_dir_beside(final: Path) -> Path:
    """A fresh hidden folder next to `final` (same filesystem: `replace_dir` is then a rename)."""
    final.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))


def replace_dir(tmp: Path, final: Path) -> None:
    """Put a finished temp folder in place of `final`: an existing `final` is moved aside first and removed
    after, so a kill at any moment leaves the old folder or the new one, never half of one."""
    if not final.exists():
        os.replace(tmp, final)
        return
    old = final.with_name(f".{final.name}.old-{os.getpid()}")
    os.replace(final, old)
    os.replace(tmp, final)
    if old.is_dir() and not old.is_symlink():
        shutil.rmtree(old, ignore_errors=True)
    else:  # a file or a link where the folder goes: it was replaced too, so it must not stay behind
        old.unlink(missing_ok=True)
