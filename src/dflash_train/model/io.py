"""Save and load a drafter in its architecture's reference format (config.json + model.safetensors)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Optional

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..algorithms import UnknownArchitecture, architecture, architecture_of_export
from ..algorithms.base import Drafter
from ..runtime import dtype_named, replace_dir, temp_dir_beside

WEIGHTS_NAME = "model.safetensors"
CONFIG_NAME = "config.json"


def save_drafter(
    drafter: Drafter,
    out_dir: str | Path,
    dtype: str = "bfloat16",
    extra_files: Optional[dict[str, str]] = None,
) -> Path:
    """Write the drafter atomically: a killed save never leaves a folder that looks complete."""
    out = Path(out_dir)
    tmp = temp_dir_beside(out)
    try:
        tensors = {k: v.detach().to("cpu", dtype_named(dtype)).contiguous() for k, v in drafter.state_dict().items()}
        save_file(tensors, str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
        (tmp / CONFIG_NAME).write_text(json.dumps(architecture(drafter.architecture).config_json(drafter, dtype), indent=2, sort_keys=True))
        for name, text in (extra_files or {}).items():
            (tmp / name).write_text(text)
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
    try:
        data = json.loads(cfg_file.read_text())
        arch = architecture_of_export(data)
        config = arch.config_from_dict(data)
    except (UnknownArchitecture, ValueError, json.JSONDecodeError) as e:
        raise ValueError(f"{cfg_file}: {e}") from e
    with torch.device("meta"):
        drafter = arch.drafter_class(config)
    expected = {k: v.shape for k, v in drafter.state_dict().items()}
    with safe_open(str(weights), framework="pt") as f:
        names = set(f.keys())
        missing = sorted(set(expected) - names)
        unexpected = sorted(names - set(expected))
        if missing or unexpected:
            raise ValueError(
                f"{weights} does not match {cfg_file}: missing tensors {missing[:8]}, unexpected tensors {unexpected[:8]}"
            )
        state = {name: f.get_tensor(name) for name in sorted(names)}
    for name, tensor in state.items():
        if tuple(tensor.shape) != tuple(expected[name]):
            raise ValueError(f"{weights}: tensor {name} has shape {tuple(tensor.shape)}, config expects {tuple(expected[name])}")
    file_dtype = next(iter(state.values())).dtype
    drafter = arch.drafter_class(config).to(device=device, dtype=dtype or file_dtype)
    drafter.load_state_dict(state, strict=True)
    return drafter
