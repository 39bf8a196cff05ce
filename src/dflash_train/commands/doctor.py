"""`dflash-train doctor`: is this machine ready to train? Versions, devices, a flex_attention compile
smoke test through our compile layer, the compile cache, and a one-line verdict."""

from __future__ import annotations

import importlib.metadata as md
import os
import platform
import tempfile
import time
from dataclasses import dataclass

from ..runtime import resolve_device, resolve_dtype


@dataclass
class Check:
    name: str
    ok: bool
    detail: str
    fatal: bool = True


def _version(pkg: str) -> str:
    try:
        return md.version(pkg)
    except md.PackageNotFoundError:
        return "not installed"


def version_line() -> str:
    """`dflash-train --version`: this package's version and those of the libraries a bug report needs, read from
    their installed metadata (torch is not imported)."""
    from .. import __version__

    libs = ", ".join(f"{pkg} {_version(pkg)}" for pkg in ("torch", "transformers"))
    return f"dflash-train {__version__} ({libs}, python {platform.python_version()})"


def versions() -> list[Check]:
    import torch

    out = [Check("python", True, platform.python_version(), fatal=False)]
    for pkg in ("torch", "triton", "transformers", "safetensors", "tensorboard"):
        v = _version(pkg)
        needed = pkg in ("torch", "transformers", "safetensors")
        out.append(Check(pkg, v != "not installed" or not needed, v, fatal=needed))
    cuda = torch.version.cuda or "none (CPU build)"
    out.append(Check("CUDA (torch build)", True, cuda, fatal=False))
    return out


def devices() -> list[Check]:
    import torch

    if not torch.cuda.is_available():
        return [Check("GPUs", True, "none visible: training runs on CPU with the sdpa backend", fatal=False)]
    checks = []
    driver = "unknown"
    try:
        import subprocess

        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=10).stdout.strip().splitlines()[0]
    except Exception:  # nvidia-smi missing is not fatal: torch already sees the GPUs
        pass
    checks.append(Check("driver", True, driver, fatal=False))
    for i in range(torch.cuda.device_count()):
        free, total = torch.cuda.mem_get_info(i)
        name = torch.cuda.get_device_name(i)
        checks.append(Check(f"cuda:{i}", True, f"{name}, {free / 2**30:.1f} / {total / 2**30:.1f} GiB free", fatal=False))
    return checks


def flex_smoke_test() -> Check:
    """Compile flex_attention through our layer and run it with a block drafter's BlockMask:
    forward + backward on GPU; forward only on CPU (FlexAttention has no CPU backward)."""
    import torch

    from ..architectures.attention import sdpa_attention
    from ..architectures.family.backend import compiled_flex_attention
    from ..architectures.family.mask import dense_mask, flex_block_mask

    dev = resolve_device("auto")
    device, dtype = dev.type, resolve_dtype("auto", dev)
    try:
        t0 = time.time()
        anchors = torch.tensor([[3, 40, 90, 0, 0, 0, 0, 0]], device=device)
        keep = torch.tensor([[True, True, True] + [False] * 5], device=device)
        s, bs = 128, 16
        q = torch.randn(1, 4, 8 * bs, 64, device=device, dtype=dtype, requires_grad=device == "cuda")
        k = torch.randn(1, 2, s + 8 * bs, 64, device=device, dtype=dtype, requires_grad=device == "cuda")
        v = torch.randn(1, 2, s + 8 * bs, 64, device=device, dtype=dtype, requires_grad=device == "cuda")
        flex = compiled_flex_attention(dynamic=device == "cuda")
        out = flex(q, k, v, block_mask=flex_block_mask(anchors, keep, s, bs), enable_gqa=True)
        ref = sdpa_attention(q.float(), k.float(), v.float(), dense_mask(anchors, keep, s, bs))
        err = ((out.float() - ref).norm() / ref.norm()).item()
        if device == "cuda":
            out.float().sum().backward()
            torch.cuda.synchronize()
        ok = err < 2e-2
        what = "forward + backward" if device == "cuda" else "forward (CPU has no flex backward)"
        return Check("flex_attention compile", ok, f"{what} on {device} in {time.time() - t0:.1f} s, rel. error {err:.1e}")
    except Exception as e:  # the verdict must report any failure, whatever its type
        return Check("flex_attention compile", False, f"{type(e).__name__}: {str(e).splitlines()[0][:300]}")


def cache_check() -> Check:
    from ..accel.compile import default_cache_dir

    path = default_cache_dir()
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path):
            pass
    except OSError as e:
        return Check("compile cache", False, f"{path} not writable: {e}; set DFLASH_TRAIN_CACHE or run.compile_cache_dir")
    size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    held = "empty: a first run compiles cold" if size == 0 else f"{size / 2**20:.0f} MiB of compiled code: a run warms from it"
    return Check("compile cache", True, f"{path} writable, {held}")


_LISTED = 3  # stale conversions named in doctor's line; the rest are counted


def target_cache_check() -> Check:
    """The converted targets in the cache, and those no GGUF known to it reaches any more (removed only by
    `remove_stale_targets`, on request)."""
    from ..assets import cached_conversions, targets_dir

    folders = cached_conversions()
    where = targets_dir()
    if not folders:
        return Check("target cache", True, f"{where}: no converted target yet", fatal=False)
    total = sum(f.size_bytes for f in folders) / 1e9
    stale = [f for f in folders if not f.reached]
    detail = f"{where}: {len(folders)} converted target(s), {total:.1f} GB"
    if stale:
        gb = sum(f.size_bytes for f in stale) / 1e9
        names = ", ".join(f.path.name for f in stale[:_LISTED]) + (
            f" and {len(stale) - _LISTED} more" if len(stale) > _LISTED else "")
        detail += (f"; {len(stale)} ({gb:.1f} GB) reached by no GGUF this cache knows of (moved, changed or gone, or "
                   f"converted before conversions were named by content): {names}; `dflash-train doctor "
                   f"--remove-stale-targets` deletes them")
    return Check("target cache", True, detail, fatal=False)


def remove_stale_targets() -> str:
    """Delete the converted targets no known GGUF reaches; what was removed (a line each) and what could not be."""
    from ..assets import remove_unreached_conversions, targets_dir

    removed, failed = remove_unreached_conversions()
    where = targets_dir()
    if removed:
        gb = sum(f.size_bytes for f in removed) / 1e9
        line = (f"{where}: removed {len(removed)} converted target(s) no known GGUF reaches, {gb:.1f} GB:"
                + "".join(f"\n  {f.path.name}" for f in removed))
    else:
        line = f"{where}: no stale converted target removed"
    return line + "".join(f"\n  could not remove {why}" for why in failed)


def compile_workers_check() -> Check:
    """How many inductor compile workers a rank starts here (as `train` sizes them)."""
    from ..accel.compile import compile_workers_per_rank, usable_cores

    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    why = "TORCHINDUCTOR_COMPILE_THREADS" if os.environ.get("TORCHINDUCTOR_COMPILE_THREADS") else \
        f"{usable_cores()} cores / {ranks} rank(s) here, at most 32"
    return Check("compile workers", True, f"{compile_workers_per_rank(ranks)} per GPU rank ({why})", fatal=False)


def run_doctor() -> tuple[list[Check], str]:
    checks = versions() + devices() + [cache_check(), target_cache_check(), compile_workers_check(), flex_smoke_test()]
    failed = [c for c in checks if c.fatal and not c.ok]
    if failed:
        verdict = "NOT READY: " + "; ".join(f"{c.name}: {c.detail}" for c in failed)
    else:
        import torch

        where = f"{torch.cuda.device_count()} GPU(s)" if torch.cuda.is_available() else "CPU only (sdpa backend)"
        verdict = f"READY: {where}, flex_attention compiles and matches the dense reference"
    return checks, verdict


def format_report(checks: list[Check], verdict: str) -> str:
    width = max(len(c.name) for c in checks)
    lines = [f"{'ok ' if c.ok else 'BAD'} {c.name:<{width}}  {c.detail}" for c in checks]
    return "\n".join(lines + ["", verdict])
