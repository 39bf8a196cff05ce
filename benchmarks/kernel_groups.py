"""A profiled step's GPU kernels by kind (`throughput.py --profile`): how much of a part's time goes to matmuls,
attention, the chunked CE, norms and other fused elementwise kernels, the optimizer, the eager ops between compiled
graphs (top-k, copies, gathers and scatters, reductions, elementwise), and how much passes with no kernel running."""

from __future__ import annotations

from typing import Iterable

# (group, fragments of the kernel's name), the first group that matches wins: inductor names its fused kernels after
# the ops they hold (`triton_red_fused_..._logsumexp_...`), so the fused groups come before the library kernels
GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("flex attention", ("flex_attention",)),
    ("chunked CE", ("logsumexp",)),
    ("norms", ("rms_norm",)),
    ("other fused elementwise", ("triton_poi_", "triton_per_", "triton_red_")),
    ("other attention", ("fmha", "sdpa", "flash")),
    ("matmuls", ("nvjet", "gemm", "xmma", "cutlass")),
    ("optimizer", ("multi_tensor_apply", "adam")),
    # ATen's own kernels, where eager code runs between the compiled graphs
    ("top-k", ("topk", "TopK", "radixFindKthValues")),
    ("copies and concatenations", ("direct_copy", "CatArrayBatchedCopy", "copy_kernel")),
    ("gathers and scatters", ("gather", "scatter", "indexFunc", "index_elementwise", "index_put")),
    ("reductions", ("reduce_kernel",)),
    ("eager elementwise", ("elementwise_kernel", "FillFunctor")),
)
OTHER = "other kernels"
IDLE = "no kernel running"


def group_of(kernel: str) -> str:
    for group, fragments in GROUPS:
        if any(f in kernel for f in fragments):
            return group
    return OTHER


def kernel_groups(kernels: Iterable[tuple[str, float]], wall_ms: float) -> dict[str, float]:
    """Milliseconds per group of `(kernel name, its own time in ms)`, largest first, and `IDLE`: the part's
    `wall_ms` less the kernels' sum (kernels of one stream do not overlap)."""
    out: dict[str, float] = {}
    for name, ms in kernels:
        out[group_of(name)] = out.get(group_of(name), 0.0) + ms
    busy = sum(out.values())
    ordered = dict(sorted(((g, round(ms, 1)) for g, ms in out.items()), key=lambda kv: -kv[1]))
    ordered[IDLE] = round(max(0.0, wall_ms - busy), 1)
    return ordered


def profiled_kernels(prof) -> list[tuple[str, float]]:
    """(name, own time ms) of each kind of device kernel a `torch.profiler.profile` recorded (not the host-side
    records of their launches)."""
    from torch.autograd import DeviceType

    return [(e.key, e.self_device_time_total / 1000) for e in prof.key_averages()
            if e.device_type == DeviceType.CUDA and e.self_device_time_total > 0]


def describe(groups: dict[str, float], wall_ms: float) -> str:
    return "; ".join(f"{g} {ms:.1f} ms ({100 * ms / wall_ms:.0f}%)" for g, ms in groups.items())
