"""Before any weights load: does this rank's GPU have the memory its part of the plan needs, and who
else holds it? Does rank 0's host have the memory for a checkpoint's snapshot? A run that cannot fit says so in
seconds instead of failing minutes later."""

from __future__ import annotations

import logging
import math
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch
from safetensors import safe_open

from ...architectures.contract import Architecture
from ...config.schema import Config
from ...errors import ResourceError
from .activation_memory import KEPT_HEAD_GRADIENT, ActivationEstimate, activation_estimate

log = logging.getLogger(__name__)

_BYTES = {torch.float32: 4, torch.bfloat16: 2, torch.float16: 2}
# Allocator slack and fragmentation, cuBLAS and NCCL workspaces, the compile workers' CUDA use: what neither the
# weights nor the activation estimate (activation_memory.py) count. This process's CUDA context is already out of
# the free figure the check reads.
MARGIN = 2 * 2**30


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


def drafter_parameters(arch: Architecture, drafter_config) -> int:
    """The trainable parameters of the drafter `drafter_config` describes (built on the meta device: no memory),
    a reduced draft vocabulary's own lm_head included."""
    with torch.device("meta"):
        drafter = arch.drafter_class(drafter_config)
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


@dataclass(frozen=True)
class MemoryNeed:
    """What one rank needs on its GPU: the resident weights (`needed_bytes` less its margin), the activations of its
    largest micro-batch, and the margin."""

    weights: int
    activations: ActivationEstimate
    margin: int = MARGIN

    @property
    def total(self) -> int:
        return self.weights + self.activations.total + self.margin

    def describe(self) -> str:
        return (f"{self.total / 2**30:.1f} GiB: weights and optimizer state {self.weights / 2**30:.1f} GiB, activations "
                f"{self.activations.describe()}, margin {self.margin / 2**30:.1f} GiB")

    def remedies(self) -> str:
        kept = self.activations.parts.get(KEPT_HEAD_GRADIENT, 0)
        first = (f"objective.head_gradient=recompute saves the kept head gradient rows ({kept / 2**30:.1f} GiB, "
                 "for a slower backward); ") if kept else ""
        return first + remedies(activations_first=self.activations.total > self.weights)


def remedies(activations_first: bool) -> str:
    """What to cut to fit, the larger part of the need first."""
    activations = ("for the activations, lower data.token_budget (or data.max_batch_size, objective.max_anchors / "
                   "objective.max_anchors_per_batch, objective.loss_chunk_size)")
    weights = ("for the weights, shard the target over more ranks (target.sharding=fsdp, target.shard_group_size), "
               "use a split placement with more target ranks, or a smaller drafter")
    first, second = (activations, weights) if activations_first else (weights, activations)
    return f"Free the GPU; {first}; {second}"


def rank_need(cfg: Config, target_path: Path, target_config, drafter_config, layer_ids: list[int],
              target_dtype: torch.dtype, compute_dtype: torch.dtype, role: str, split: bool,
              share: Optional[TargetShare] = None, target_bytes_saved: int = 0,
              device_type: str = "cuda", *, arch: Architecture) -> tuple[MemoryNeed, str]:
    """(what a rank of `role` needs, the words for it) from the config, the target's config.json and its
    safetensors headers alone: nothing is loaded. `split`: the placement is split (a drafter rank then also holds the
    target's embedding and lm_head). `arch`: the run's architecture, whose drafter `drafter_config` describes."""
    drafter_params = drafter_parameters(arch, drafter_config)  # its own lm_head included
    trained = drafter_params
    if role == "drafter" and split:  # plus the target's embedding and lm_head (bf16 twice: a quarter of 16 bytes)
        drafter_params += target_config.vocab_size * target_config.hidden_size // 4
    weights = needed_bytes(checkpoint_parameters(target_path), target_dtype, drafter_params, role, share,
                           target_bytes_saved=target_bytes_saved) - MARGIN
    activations = activation_estimate(role, cfg, target_config, drafter_config, layer_ids, target_dtype, compute_dtype,
                                      device_type, trained, arch=arch)
    what = f"the {role} rank's weights, optimizer state and activations" + (
        f" (a 1/{share.parts} shard of the target's layers, {share.GATHERED_LAYERS} layers gathered)" if share else "")
    return MemoryNeed(weights, activations), what


def check_gpu(device: torch.device, need: "int | MemoryNeed", rank: int, what: str,
              free_memory: Optional[Callable[[torch.device], tuple[int, int]]] = None) -> None:
    """Raise if `device` has less free memory than `need`; name who holds it, the parts of the need and what to cut.
    `free_memory`: (free, total) bytes of a device, `torch.cuda.mem_get_info` unless given (a CPU device is then
    not checked: it has no device memory)."""
    if free_memory is None:
        if device.type != "cuda":
            return
        free_memory = torch.cuda.mem_get_info
    free, total = free_memory(device)
    others = other_processes(device.index) if device.type == "cuda" else []
    held = f"; other processes on it: {', '.join(others)}" if others else ""
    needed = need.total if isinstance(need, MemoryNeed) else need
    parts = f" ({need.describe()})" if isinstance(need, MemoryNeed) else ""
    cut = need.remedies() if isinstance(need, MemoryNeed) else remedies(activations_first=False)
    if free < needed:
        raise ResourceError(
            f"preflight: rank {rank} on {device} needs about {needed / 2**30:.1f} GiB for {what}{parts}, but only "
            f"{free / 2**30:.1f} of {total / 2**30:.1f} GiB are free{held}. {cut}"
        )
    if others:
        log.warning("rank %d: %s is shared%s", rank, device, held)
    log.info("preflight: rank %d on %s: %.1f GiB free, about %.1f GiB needed for %s%s", rank, device,
             free / 2**30, needed / 2**30, what, parts)


# ------------------------------------------------------------------------------- host memory of a checkpoint


@dataclass(frozen=True)
class SnapshotNeed:
    """The host memory of one checkpoint snapshot (train/checkpoint.py `Snapshot`: rank 0 copies the state there and
    writes the files from it in the background; on CUDA these are pinned buffers kept for the whole run)."""

    weights: int  # the drafter's state dict in float32 (integer buffers as they are)
    optimizer: int  # AdamW: two float32 moments a trained parameter, and a step count a tensor

    @property
    def total(self) -> int:
        return self.weights + self.optimizer


def snapshot_need(arch: Architecture, drafter_config) -> SnapshotNeed:
    """From the drafter's config alone (built on the meta device)."""
    with torch.device("meta"):
        drafter = arch.drafter_class(drafter_config)
    weights = sum(t.numel() * (4 if t.is_floating_point() else t.element_size()) for t in drafter.state_dict().values())
    optimizer = sum(2 * p.numel() * 4 + 4 for p in drafter.parameters() if p.requires_grad)
    return SnapshotNeed(weights, optimizer)


def host_memory() -> Optional[tuple[int, int]]:
    """(available, total) bytes of host memory: MemAvailable and MemTotal of /proc/meminfo (None elsewhere)."""
    try:
        fields = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines() if ":" in line)
        return int(fields["MemAvailable"].split()[0]) * 1024, int(fields["MemTotal"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None


def check_host_snapshot(need: SnapshotNeed, rank: int,
                        memory: Optional[Callable[[], Optional[tuple[int, int]]]] = None) -> None:
    """Raise if the host has less available memory than a checkpoint snapshot needs. `memory`: (available, total)
    bytes, `host_memory` unless given (not checked where it is unknown)."""
    got = (memory or host_memory)()
    if got is None:
        return
    available, total = got
    what = (f"{need.total / 2**30:.1f} GiB of host memory for a checkpoint snapshot (drafter weights "
            f"{need.weights / 2**30:.1f} GiB + optimizer state {need.optimizer / 2**30:.1f} GiB, float32: what a "
            "save copies out of the training before it is written in the background)")
    if available < need.total:
        raise ResourceError(
            f"preflight: rank {rank} needs about {what}, but only {available / 2**30:.1f} of {total / 2**30:.1f} "
            "GiB are available (MemAvailable in /proc/meminfo). Free host memory (other processes on this machine) "
            "or train a smaller drafter"
        )
    log.info("preflight: rank %d: %.1f GiB of host memory available, about %s", rank, available / 2**30, what)
