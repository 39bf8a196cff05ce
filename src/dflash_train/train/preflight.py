"""Before any weights load: does this rank's GPU have the memory its part of the plan needs, and who
else holds it? A run that cannot fit says so in seconds instead of failing minutes later."""

from __future__ import annotations

import logging
import math
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from safetensors import safe_open

from ..algorithms import architecture

log = logging.getLogger(__name__)

_BYTES = {torch.float32: 4, torch.bfloat16: 2, torch.float16: 2}
MARGIN = 2 * 2**30  # CUDA context, allocator slack, the first activations


# A decoder layer's tensors in a text or multimodal checkpoint (not a vision tower's blocks).
_DECODER_LAYER = re.compile(r"(?:^|\.)(?:model|language_model)\.layers\.(\d+)\.")


def _tensor_sizes(path: Path):
    for file in sorted(Path(path).glob("*.safetensors")):
        with safe_open(file, framework="pt") as f:
            for key in f.keys():
                yield key, math.prod(f.get_slice(key).get_shape())


def checkpoint_parameters(path: Path) -> int:
    """Parameter count of a safetensors checkpoint, from the file headers alone (a MoE target: every expert,
    all resident however few a token uses)."""
    return sum(n for _, n in _tensor_sizes(path))


@dataclass
class TargetShare:
    """What one rank of a sharded target (`target.sharding: fsdp`) holds: a 1/`parts` slice of the decoder layers,
    the rest (embedding, final norm, lm_head) whole, and during a capture the gathered weights of a few layers."""

    parts: int
    layer_params: int  # all decoder layers together
    largest_layer: int

    # A layer gathered for its forward, the next one prefetched, and the all-gather's input copy.
    GATHERED_LAYERS = 3

    @classmethod
    def of(cls, path: Path, parts: int) -> "TargetShare":
        layers: dict[int, int] = {}
        for key, n in _tensor_sizes(path):
            m = _DECODER_LAYER.search(key)
            if m:
                layers[int(m.group(1))] = layers.get(int(m.group(1)), 0) + n
        return cls(parts, sum(layers.values()), max(layers.values(), default=0))

    def parameters(self, target_params: int) -> int:
        """Parameters' worth of memory this rank needs for the target: its shard, the whole rest, the gathered."""
        return (target_params - self.layer_params + math.ceil(self.layer_params / self.parts)
                + self.GATHERED_LAYERS * self.largest_layer)


def drafter_parameters(architecture_name: str, drafter_config) -> int:
    """The trainable parameters of the drafter `drafter_config` describes (built on the meta device: no memory),
    a reduced draft vocabulary's own lm_head included."""
    with torch.device("meta"):
        drafter = architecture(architecture_name).drafter_class(drafter_config)
    return sum(p.numel() for p in drafter.parameters() if p.requires_grad)


def needed_bytes(target_params: int, target_dtype: torch.dtype, drafter_params: int, role: str,
                 share: Optional[TargetShare] = None, *, target_bytes_saved: int = 0) -> int:
    """Weights that must be resident: the frozen target (target and colocated ranks; with `share`, a sharded
    target's part) and the drafter with float32 master weights, gradients and AdamW moments (16 bytes a
    parameter; drafter ranks). `target_bytes_saved`: what `target.quantize=fp8` saves (its linears at 1 byte a
    weight plus a float32 scale per output channel: `fp8.quantized_bytes_saved`)."""
    need = MARGIN
    if role in ("target", "colocated"):
        need += (target_params if share is None else share.parameters(target_params)) * _BYTES[target_dtype]
        need -= target_bytes_saved
    if role in ("drafter", "colocated"):
        need += drafter_params * 16
    return need


def other_processes(device_index: int) -> list[str]:
    """`pid (GiB)` of other processes on that GPU, from nvidia-smi when it is installed."""
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        uuid = torch.cuda.get_device_properties(device_index).uuid
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory,gpu_uuid", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError, RuntimeError):
        return []
    found = []
    for line in out.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 3 and str(uuid) in parts[2] and parts[0] != str(os.getpid()):
            found.append(f"pid {parts[0]} ({int(parts[1]) / 1024:.1f} GiB)")
    return found


def check_gpu(device: torch.device, need: int, rank: int, what: str) -> None:
    """Raise if `device` has less free memory than `need`; name who holds it."""
    if device.type != "cuda":
        return
    free, total = torch.cuda.mem_get_info(device)
    others = other_processes(device.index)
    held = f"; other processes on it: {', '.join(others)}" if others else ""
    if free < need:
        raise RuntimeError(
            f"preflight: rank {rank} on cuda:{device.index} needs about {need / 2**30:.1f} GiB for {what}, but only "
            f"{free / 2**30:.1f} of {total / 2**30:.1f} GiB are free{held}. Free the GPU, shard the target over more "
            "ranks (target.sharding=fsdp, target.shard_group_size), use a split placement with more target ranks, "
            "or a smaller drafter"
        )
    if others:
        log.warning("rank %d: cuda:%d is shared%s", rank, device.index, held)
    log.info("preflight: rank %d on cuda:%d: %.1f GiB free, about %.1f GiB needed for %s", rank, device.index,
             free / 2**30, need / 2**30, what)
