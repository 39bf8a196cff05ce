"""A frozen target split tensor-parallel over the ranks of a shard group (`target.sharding: tp`), with PyTorch's
own `parallelize_module`: in every decoder layer q/k/v and gate/up are column-parallel (each rank holds whole
heads and a slice of the MLP width: rows of dim 0), o and down row-parallel (the matching columns of dim 1; their
partial outputs all-reduced, twice per layer). Activations between the projections stay plain local tensors, so a
layer's output is a whole, replicated `torch.Tensor`. The embedding, the norms (q/k norms act per head) and the
lm_head stay whole. Built on the meta device; each rank then reads only its rows or columns (target/shard.py's
reader). Dense attention + gated-MLP layers only: a MoE target (or any other layer kind) is refused up front."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from transformers import PretrainedConfig, PreTrainedModel

from ..errors import ConfigError
from .shard import SHARD_DIM, fill_from_checkpoint, peak_host_gib, resident_bytes, skeleton
from .hf_model import decoder_of

log = logging.getLogger(__name__)

# Per decoder layer: the submodule -> column-parallel (True) or row-parallel (False).
LAYER_PLAN = {
    "self_attn.q_proj": True, "self_attn.k_proj": True, "self_attn.v_proj": True, "self_attn.o_proj": False,
    "mlp.gate_proj": True, "mlp.up_proj": True, "mlp.down_proj": False,
}
# Attention kinds whose projections split by heads as above (a linear-attention layer has others).
_SPLITTABLE_LAYER_TYPES = {"full_attention", "sliding_attention"}
_EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts")


def check_tp_target(text_config: PretrainedConfig, parts: int) -> None:
    """From the target's config.json alone, before any weights load: a target that `parts` ranks cannot split
    (a MoE one, layers other than attention + MLP, head counts or an MLP width not divisible) is refused."""
    experts = [k for k in _EXPERT_COUNTS if (getattr(text_config, k, 0) or 0) > 0]
    if experts:
        raise ConfigError(
            f"config key 'target.sharding': tp splits dense attention and MLP layers; this target is a mixture of "
            f"experts ({experts[0]}={getattr(text_config, experts[0])}), which tp does not split yet; use "
            "target.sharding=fsdp (each rank holds its experts)")
    kinds = set(getattr(text_config, "layer_types", None) or []) - _SPLITTABLE_LAYER_TYPES
    if kinds:
        raise ConfigError(
            f"config key 'target.sharding': tp splits attention layers by heads; this target has layers of kind "
            f"{', '.join(sorted(kinds))}, which tp does not split; use target.sharding=fsdp")
    sizes = {k: getattr(text_config, k, None) for k in ("num_attention_heads", "num_key_value_heads",
                                                        "intermediate_size")}
    uneven = {k: v for k, v in sizes.items() if not isinstance(v, int) or v % parts}
    if uneven:
        raise ConfigError(
            f"config key 'target.shard_group_size': tp over {parts} ranks splits every layer's heads and MLP width "
            f"evenly, but the target's {', '.join(f'{k}={v}' for k, v in uneven.items())} "
            f"{'does' if len(uneven) == 1 else 'do'} not divide by {parts}; give a shard group size that divides "
            f"{', '.join(f'{k}={v}' for k, v in sizes.items())}, or use target.sharding=fsdp")


def _check_layers(decoder: nn.Module) -> None:
    """Every decoder layer has the plan's projections, as plain linears (a family with other module names or
    fused projections is refused before any weights load)."""
    for i, layer in enumerate(decoder.layers):
        missing = [n for n in LAYER_PLAN if not (_has(layer, n) and isinstance(layer.get_submodule(n), nn.Linear))]
        if missing:
            raise ConfigError(
                f"config key 'target.sharding': tp needs each decoder layer's {', '.join(LAYER_PLAN)} as linear "
                f"layers; layer {i} ({type(layer).__name__}) lacks {', '.join(missing)}; use target.sharding=fsdp")


def _has(module: nn.Module, name: str) -> bool:
    try:
        module.get_submodule(name)
    except AttributeError:
        return False
    return True


def load_tp_target(path: str | Path, dtype: torch.dtype, device: torch.device, mesh: DeviceMesh,
                   trust_remote_code: bool = False) -> PreTrainedModel:
    """The target with every decoder layer tensor-parallel over `mesh`'s shard dimension (several shard groups:
    each a whole copy), frozen, in eval mode, each rank having read only its rows and columns of each layer's
    projections (and the whole rest)."""
    path = Path(path)
    model, mapped = skeleton(path, dtype, trust_remote_code)
    check_tp_target(model.config.get_text_config(decoder=True), mesh[SHARD_DIM].size())
    decoder = decoder_of(model)
    _check_layers(decoder)
    plan = {name: ColwiseParallel() if column else RowwiseParallel() for name, column in LAYER_PLAN.items()}
    for layer in decoder.layers:
        parallelize_module(layer, mesh[SHARD_DIM], plan)
    fill_from_checkpoint(model, path, mapped, dtype, device, "tp")
    log.info("target tensor-parallel over %d rank(s) (column/row-parallel projections): %.2f GiB of weights on "
             "this rank; peak host memory %.2f GiB", mesh[SHARD_DIM].size(), resident_bytes(model) / 2**30,
             peak_host_gib())
    return model


def shard_group_of(decoder: nn.Module) -> Optional[dist.ProcessGroup]:
    """The process group a tensor-parallel decoder's layers all-reduce over (None: not tensor parallel). Told
    apart from an FSDP2 decoder, whose layers hold DTensors too, by a row-parallel weight: FSDP2 shards dim 0."""
    for param in decoder.layers.parameters():
        if isinstance(param, DTensor) and param.device_mesh.ndim == 1 and param.placements[0] == Shard(1):
            return param.device_mesh.get_group()
    return None


def members_inputs(input_ids: torch.Tensor, group: dist.ProcessGroup) -> tuple[list[torch.Tensor], int]:
    """Every group member's `input_ids` (shapes may differ) and this rank's index among them: a tensor-parallel
    forward needs the same input on all ranks of the group, and each rank has its own micro-batch. One
    all-gather of the shapes, one of the batches padded to the largest."""
    members, me = dist.get_world_size(group), dist.get_rank(group)
    shape = torch.tensor(input_ids.shape, dtype=torch.long, device=input_ids.device)
    shapes = [torch.empty_like(shape) for _ in range(members)]
    dist.all_gather(shapes, shape, group=group)
    sizes = [tuple(s.tolist()) for s in shapes]
    rows, length = max(b for b, _ in sizes), max(s for _, s in sizes)
    padded = input_ids.new_zeros(rows, length)
    padded[: input_ids.shape[0], : input_ids.shape[1]] = input_ids
    gathered = [torch.empty_like(padded) for _ in range(members)]
    dist.all_gather(gathered, padded, group=group)
    return [g[:b, :s] for g, (b, s) in zip(gathered, sizes)], me
