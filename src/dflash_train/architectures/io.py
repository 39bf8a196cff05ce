"""Save and load a drafter in its architecture's reference format (config.json + model.safetensors)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Optional

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from . import UnknownArchitecture, architecture, architecture_of_export
from .drafter import Drafter
from ..errors import DamagedFileError, ModelError
from ..files.io import read_json_file, replace_dir, temp_dir_beside
from ..files.layout import CONFIG_NAME, STATE, WEIGHTS_NAME
from ..files.permissions import follow_umask
from ..runtime import dtype_named

def save_drafter(
    drafter: Drafter,
    out_dir: str | Path,
    dtype: str = "bfloat16",
    extra_files: Optional[dict[str, str]] = None,
) -> Path:
    """Write the drafter atomically: a killed save never leaves a folder that looks complete."""
    return write_drafter_files(drafter_tensors(drafter, dtype), drafter_config_text(drafter, dtype), out_dir,
                               extra_files)


def drafter_tensors(drafter: Drafter, dtype: str) -> dict[str, torch.Tensor]:
    """The tensors `save_drafter` writes, on the CPU: weights in `dtype`; integer tensors (a reduced vocabulary's
    `d2t` offsets, int64 as vLLM reads them) as they are."""
    return {k: v.detach().to("cpu", dtype_named(dtype) if v.is_floating_point() else v.dtype).contiguous()
            for k, v in drafter.state_dict().items()}


def drafter_config_text(drafter: Drafter, dtype: str) -> str:
    """The config.json `save_drafter` writes for weights in `dtype`."""
    return json.dumps(architecture(drafter.architecture).config_json(drafter, dtype), indent=2, sort_keys=True)


def write_drafter_files(tensors: dict[str, torch.Tensor], config_text: str, out_dir: str | Path,
                        extra_files: Optional[dict[str, str]] = None) -> Path:
    """A drafter folder from its CPU tensors and config.json text (`drafter_tensors`, `drafter_config_text`: a
    checkpoint writes them from a snapshot taken earlier), atomically."""
    out = Path(out_dir)
    tmp = temp_dir_beside(out)
    try:
        save_file(tensors, str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
        (tmp / CONFIG_NAME).write_text(config_text)
        for name, text in (extra_files or {}).items():
            (tmp / name).write_text(text)
        follow_umask(tmp)
        replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def load_drafter(path: str | Path, device: str | torch.device = "cpu", dtype: Optional[torch.dtype] = None) -> Drafter:
    """Load an exported drafter strictly: every tensor name and shape must match the config."""
    path = Path(path)
    cfg_file, weights = path / CONFIG_NAME, path / WEIGHTS_NAME
    for f in (cfg_file, weights):
        if not f.is_file():
            raise FileNotFoundError(f"{f} is missing: {path} is not an exported DFlash drafter")
    in_checkpoint = (path.parent / STATE).is_file()  # a checkpoint's drafter/ folder sits beside its trainer_state.json
    redo = (f"resume or export from another checkpoint than {path.parent}" if in_checkpoint
            else "export the checkpoint again (dflash-train export RUN/checkpoints/step-N --out DIR) or copy the "
                 "drafter folder again")
    data = read_json_file(cfg_file, redo)
    try:
        arch = architecture_of_export(data)
        config = arch.config_from_dict(data)
    except (UnknownArchitecture, ValueError) as e:
        raise ModelError(f"{cfg_file}: {e}") from e
    with torch.device("meta"):
        drafter = arch.drafter_class(config)
    expected = {k: v.shape for k, v in drafter.state_dict().items()}
    expected_dtypes = {k: v.dtype for k, v in drafter.state_dict().items()}
    try:
        with safe_open(str(weights), framework="pt") as f:
            names = set(f.keys())
            missing = sorted(set(expected) - names)
            unexpected = sorted(names - set(expected))
            if missing or unexpected:
                raise ModelError(f"{weights} does not match {cfg_file}: missing tensors {missing[:8]}, unexpected "
                                 f"tensors {unexpected[:8]}")
            state = {name: f.get_tensor(name) for name in sorted(names)}
    except SafetensorError as e:
        raise DamagedFileError(weights, f"not a readable safetensors file: {e}", redo,
                               size=weights.stat().st_size) from None
    for name, tensor in state.items():
        if tuple(tensor.shape) != tuple(expected[name]):
            raise ModelError(f"{weights}: tensor {name} has shape {tuple(tensor.shape)}, config expects {tuple(expected[name])}")
        if not expected_dtypes[name].is_floating_point and tensor.dtype != expected_dtypes[name]:
            raise ModelError(f"{weights}: tensor {name} is {tensor.dtype}, config expects {expected_dtypes[name]}")
    file_dtype = next(t.dtype for t in state.values() if t.is_floating_point())
    drafter = arch.drafter_class(config).to(device=device, dtype=dtype or file_dtype)
    drafter.load_state_dict(state, strict=True)
    if drafter.draft_vocab_size:
        check_draft_vocabulary(drafter, weights)
    return drafter


def check_draft_vocabulary(drafter: Drafter, weights: Path) -> None:
    """A reduced vocabulary's `d2t` must map the draft ids to distinct target ids inside the vocabulary."""
    ids = drafter.vocabulary_ids()
    vocab = int(drafter.config.vocab_size)
    if int(ids.min()) < 0 or int(ids.max()) >= vocab or len(torch.unique(ids)) != len(ids):
        raise ModelError(f"{weights}: tensor d2t maps the {len(ids)} draft ids to target ids "
                         f"{int(ids.min())}..{int(ids.max())} ({len(torch.unique(ids))} distinct): they must be "
                         f"distinct and in 0..{vocab - 1} (target id = draft id + d2t[draft id])")
