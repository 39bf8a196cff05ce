"""A frozen target sharded over ranks with FSDP2 (`target.sharding: fsdp`): each decoder layer is its own
`fully_shard` unit (its weights split along dim 0 over the shard group, all-gathered for its forward and freed
after it), the decoder the root; the embedding, final norm and lm_head stay whole on every rank (the drafter
needs them). Built on the meta device; each rank then reads only its rows of every layer tensor from the
safetensors checkpoint (a MoE layer's experts: only its own experts' tensors), never a full copy."""

from __future__ import annotations

import json
import logging
import re
import resource
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from accelerate import init_empty_weights
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard
from transformers import AutoConfig, PreTrainedModel

from .hf_model import MULTIMODAL_KEY_MAPPING, checkpoint_keys, decoder_of, model_class

log = logging.getLogger(__name__)

SHARD_DIM = "shard"

# A MoE layer's experts fused into 3-D tensors in the model, one tensor per expert on disk (the Qwen2/Qwen3-MoE
# layout that transformers converts at load): model tensor suffix -> per-expert checkpoint tensors concatenated
# along dim 0 for one expert (gate rows first: the fused forward splits the projection gate, up).
_FUSED_EXPERTS = {
    "experts.gate_up_proj": ("gate_proj.weight", "up_proj.weight"),
    "experts.down_proj": ("down_proj.weight",),
}


def shard_mesh(device: torch.device, ranks: list[int], group_size: int) -> DeviceMesh:
    """`ranks` (the ranks that run the target) in shard groups of `group_size` consecutive ranks: one group (plain
    FSDP) or several that each hold the whole target (HSDP: replicated across groups, sharded within). Every rank
    of the run calls it (its process groups are made collectively), also a rank outside `ranks`."""
    if len(ranks) % group_size:
        raise ValueError(f"target.shard_group_size={group_size} does not divide the {len(ranks)} target ranks")
    if group_size == len(ranks):
        return DeviceMesh(device.type, torch.tensor(ranks), mesh_dim_names=(SHARD_DIM,))
    return DeviceMesh(device.type, torch.tensor(ranks).view(-1, group_size), mesh_dim_names=("replicate", SHARD_DIM))


def rows_of(total: int, parts: int, index: int) -> tuple[int, int]:
    """The rows [start, end) of dim 0 that shard `index` of `parts` holds: FSDP2 splits like `torch.chunk`
    (ceil-sized pieces; the last ones may be short or empty)."""
    size = -(-total // parts)
    start = min(index * size, total)
    return start, min(start + size, total)


# safetensors dtype names (the format's header) -> torch dtypes.
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}


# A column slice is read this many bytes of whole rows at a time (the only transient beyond a rank's share).
_COLUMN_BLOCK_BYTES = 16 * 2**20


class _SafetensorsFile:
    """Rows of a tensor read from one safetensors file with plain reads: a row range of a row-major tensor is
    one contiguous byte range, so a rank reads (and holds) exactly its share. Memory-mapping the file instead
    would count every page it touched as this process's memory until the map closes."""

    def __init__(self, path: Path):
        self.path = path
        self.file = open(path, "rb")
        size = int.from_bytes(self.file.read(8), "little")
        self.header = json.loads(self.file.read(size))
        self.header.pop("__metadata__", None)
        self.base = 8 + size

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.header[key]["shape"])

    def rows(self, key: str, start: int, end: Optional[int]) -> torch.Tensor:
        entry = self.header[key]
        dtype, shape = _DTYPES[entry["dtype"]], entry["shape"]
        first, last = entry["data_offsets"]
        if not shape:  # a scalar: read whole
            self.file.seek(self.base + first)
            return torch.frombuffer(bytearray(self.file.read(last - first)), dtype=dtype).reshape(())
        end = shape[0] if end is None else end
        row_bytes = (last - first) // shape[0] if shape and shape[0] else 0
        out = torch.empty((end - start) * row_bytes, dtype=torch.uint8)
        self.file.seek(self.base + first + start * row_bytes)
        if self.file.readinto(memoryview(out.numpy())) != out.numel():
            raise OSError(f"{self.path}: tensor {key} ends before its header says (a truncated checkpoint?)")
        return out.view(dtype).reshape(end - start, *shape[1:])

    def columns(self, key: str, start: int, end: int) -> torch.Tensor:
        """Columns [start, end) of a 2-D tensor (a row-parallel weight's input slice): read a bounded block of
        rows at a time and keep only the columns, so a rank holds its share plus one block, never the tensor."""
        entry = self.header[key]
        dtype, shape = _DTYPES[entry["dtype"]], entry["shape"]
        if len(shape) != 2:
            raise ValueError(f"{self.path}: tensor {key} has shape {shape}; a column slice needs a 2-D tensor")
        rows, cols = shape
        row_bytes = (entry["data_offsets"][1] - entry["data_offsets"][0]) // rows if rows else 0
        out = torch.empty(rows, end - start, dtype=dtype)
        block_rows = max(1, _COLUMN_BLOCK_BYTES // max(row_bytes, 1))
        block = torch.empty(min(block_rows, rows) * row_bytes, dtype=torch.uint8)
        self.file.seek(self.base + entry["data_offsets"][0])
        for first in range(0, rows, block_rows):
            n = min(block_rows, rows - first)
            if self.file.readinto(memoryview(block.numpy())[: n * row_bytes]) != n * row_bytes:
                raise OSError(f"{self.path}: tensor {key} ends before its header says (a truncated checkpoint?)")
            out[first:first + n] = block[: n * row_bytes].view(dtype).view(n, cols)[:, start:end]
        return out

    def close(self) -> None:
        self.file.close()


@dataclass
class _Checkpoint:
    """The checkpoint's tensors by the model's parameter names (multimodal prefixes mapped), read lazily."""

    files: dict[str, Path]  # checkpoint key -> file
    by_name: dict[str, str]  # model parameter name -> checkpoint key
    _open: dict

    @classmethod
    def of(cls, path: Path, mapped: bool) -> "_Checkpoint":
        files = checkpoint_keys(path)
        by_name = {}
        for key in files:
            name = key
            if mapped:
                for pattern, repl in MULTIMODAL_KEY_MAPPING.items():
                    name, n = re.subn(pattern, repl, key)
                    if n:
                        break
            by_name[name] = key
        return cls(files, by_name, {})

    def _file(self, key: str) -> _SafetensorsFile:
        path = self.files[key]
        if path not in self._open:
            self._open[path] = _SafetensorsFile(path)
        return self._open[path]

    def rows(self, name: str, start: int, end: Optional[int]) -> Optional[torch.Tensor]:
        """Rows [start, end) of the model tensor `name` (None: no rows); only those bytes are read."""
        if end is not None and end <= start:
            return None
        key = self.by_name.get(name)
        if key is not None:
            return self._file(key).rows(key, start, end)
        for suffix, parts in _FUSED_EXPERTS.items():
            if name.endswith(suffix):
                base = name[: -len(suffix)] + "experts."
                per_expert = [[f"{base}{e}.{p}" for p in parts] for e in range(start, end)]
                if all(n in self.by_name for names in per_expert for n in names):
                    return torch.stack([torch.cat([self.rows(n, 0, None) for n in names]) for names in per_expert])
        raise KeyError(name)

    def columns(self, name: str, start: int, end: int) -> torch.Tensor:
        """Columns [start, end) of the 2-D model tensor `name`; only whole-row blocks pass through memory."""
        key = self.by_name.get(name)
        if key is None:
            raise KeyError(name)
        return self._file(key).columns(key, start, end)

    def close(self) -> None:
        for f in self._open.values():
            f.close()
        self._open.clear()


def skeleton(path: Path, dtype: torch.dtype, trust_remote_code: bool) -> tuple[PreTrainedModel, bool]:
    """The target's module tree with its parameters on the meta device and its buffers real (the rotary
    frequencies are computed at construction, not stored in the checkpoint). Also: whether checkpoint names
    need the multimodal prefix mapping (a text model built from a multimodal checkpoint)."""
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    model_cls, build_config = model_class(config)
    with init_empty_weights(include_buffers=False):
        if issubclass(model_cls, PreTrainedModel):
            model = model_cls._from_config(build_config, dtype=dtype)
        else:
            model = model_cls.from_config(build_config, dtype=dtype, trust_remote_code=trust_remote_code)
    return model.eval().requires_grad_(False), build_config is not config


def _keep_output_recording(module: nn.Module) -> None:
    """transformers 5 looks up what a model can record (`output_hidden_states`, which speculative decoding reads)
    by the name of its class, and `fully_shard` gives the module a class of its own: register it under that one
    too, as the model's constructor did under the first. Older transformers collect hidden states in the forward
    itself and have no such registry."""
    try:
        from transformers.utils.output_capturing import _CAN_RECORD_REGISTRY
    except ImportError:
        return
    _CAN_RECORD_REGISTRY[module] = getattr(module, "_can_record_outputs", None)


def peak_host_gib() -> float:
    """This process's peak resident memory so far (Linux reports kilobytes)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def load_sharded_target(path: str | Path, dtype: torch.dtype, device: torch.device, mesh: DeviceMesh,
                        trust_remote_code: bool = False) -> PreTrainedModel:
    """The target with every decoder layer a `fully_shard` unit over `mesh`'s shard dimension, frozen, in eval
    mode, each rank holding and having read only its rows of each layer tensor (and the whole embedding, final
    norm and lm_head). `prepare_capture` runs its first forward (`TargetCapture.from_model` does)."""
    path = Path(path)
    model, mapped = skeleton(path, dtype, trust_remote_code)
    decoder = decoder_of(model)
    for layer in decoder.layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=True)
    whole = {p for n, p in decoder.named_parameters() if not n.startswith("layers.")}
    fully_shard(decoder, mesh=mesh, reshard_after_forward=True, ignored_params=whole)
    _keep_output_recording(decoder)
    fill_from_checkpoint(model, path, mapped, dtype, device, "fsdp")
    log.info("target sharded over %d rank(s) (FSDP2, one unit per decoder layer): %.2f GiB of weights on this rank; "
             "peak host memory %.2f GiB", mesh[SHARD_DIM].size(), resident_bytes(model) / 2**30, peak_host_gib())
    return model


def fill_from_checkpoint(model: PreTrainedModel, path: Path, mapped: bool, dtype: torch.dtype, device: torch.device,
                         sharding: str) -> None:
    """A skeleton's (sharded) meta parameters made real on `device` and read from the checkpoint, each rank its
    piece; its real buffers kept; a tied lm_head tied again (to_empty made it a tensor of its own)."""
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    model.to_empty(device=device)
    with torch.no_grad():
        for name, b in model.named_buffers():
            b.copy_(buffers[name])
    checkpoint = _Checkpoint.of(path, mapped)
    try:
        read_weights(model, checkpoint, dtype, sharding)
    finally:
        checkpoint.close()
    if getattr(model.config.get_text_config(decoder=True), "tie_word_embeddings", False):
        model.get_output_embeddings().weight = model.get_input_embeddings().weight


def _slice_of(param: nn.Parameter) -> tuple[int, int, Optional[int]]:
    """(dim, start, end): the piece of the checkpoint tensor this rank holds of `param`, split along `dim` like
    `torch.chunk` over its mesh dimension that shards it (FSDP: dim 0; tensor parallel: dim 0 column-parallel,
    dim 1 row-parallel); all of it (end None) for a plain or a replicated tensor."""
    if isinstance(param, DTensor):
        for mesh_dim, placement in enumerate(param.placements):
            if isinstance(placement, Shard):
                mesh = param.device_mesh
                return (placement.dim, *rows_of(param.shape[placement.dim], mesh.size(mesh_dim),
                                                mesh.get_local_rank(mesh_dim)))
    return 0, 0, None


def read_weights(model: PreTrainedModel, checkpoint: _Checkpoint, dtype: torch.dtype, sharding: str) -> None:
    """Fill every parameter from the checkpoint: a sharded one with this rank's piece only."""
    tied = model.get_output_embeddings().weight if getattr(model.config.get_text_config(decoder=True),
                                                           "tie_word_embeddings", False) else None
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param is tied and name not in checkpoint.by_name:
                continue  # the lm_head is the embedding (tied after loading)
            local = param.to_local() if isinstance(param, DTensor) else param
            dim, start, end = _slice_of(param)
            if end is not None and end <= start:  # an empty shard (fewer rows than ranks)
                continue
            try:
                piece = checkpoint.columns(name, start, end) if dim == 1 else checkpoint.rows(name, start, end)
            except KeyError:
                raise KeyError(f"target.sharding={sharding}: the target's tensor {name} is not in its safetensors "
                               f"checkpoint under that name (nor as per-expert tensors); load it with "
                               f"target.sharding=none, or save the checkpoint with save_pretrained") from None
            if tuple(piece.shape) != tuple(local.shape):
                raise ValueError(f"target.sharding={sharding}: {name} [{start}:{end}] of dim {dim} read as "
                                 f"{tuple(piece.shape)}, the model holds {tuple(local.shape)} here (a checkpoint of "
                                 "another shape?)")
            local.copy_(piece.to(dtype))


def resident_bytes(model: nn.Module) -> int:
    """Bytes of parameters this rank holds (its shards, and the whole tensors)."""
    seen, total = set(), 0
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        local = p.to_local() if isinstance(p, DTensor) else p
        total += local.numel() * local.element_size()
    return total


def prepare_capture(decoder: nn.Module, last: int) -> None:
    """Each layer before `last` asks for the next one's all-gather as it starts, so that communication overlaps
    the compute on a GPU (`last` prefetches nothing: no capture runs past it). Then one token through every layer:
    the first forward through the root decides which FSDP state is the root and which layers it drives, so it
    must see all of them (captures then run only up to their last layer); it also proves the shards assemble."""
    layers = list(decoder.layers)
    for i in range(min(last, len(layers) - 1)):
        layers[i].set_modules_to_forward_prefetch([layers[i + 1]])
    device = decoder.get_input_embeddings().weight.device
    with torch.no_grad():
        decoder(input_ids=torch.zeros(1, 1, dtype=torch.long, device=device), use_cache=False)
