"""Save and load a drafter in the reference DFlash format (config.json + model.safetensors)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Optional

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..runtime import dtype_named, replace_dir, temp_dir_beside
from .drafter import DFlashDrafter
from .drafter_config import drafter_config_from_dict

WEIGHTS_NAME = "model.safetensors"
CONFIG_NAME = "config.json"


def drafter_config_json(drafter: DFlashDrafter, dtype: str) -> dict[str, Any]:
    data = drafter.config.to_dict()
    data["architectures"] = ["DFlashDraftModel"]
    data["model_type"] = "qwen3"
    data["dtype"] = dtype
    data["torch_dtype"] = dtype  # transformers 4.x name
    data["block_size"] = drafter.block_size
    data["num_target_layers"] = int(drafter.config.num_target_layers)
    data["dflash_config"] = dict(drafter.config.dflash_config)
    # Older loaders read rope_theta / rope_scaling; newer ones read rope_parameters.
    rope = data.get("rope_parameters") or {}
    if "rope_theta" not in data and "rope_theta" in rope:
        data["rope_theta"] = rope["rope_theta"]
        if rope.get("rope_type", "default") != "default":
            data["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    for key in ("id2label", "label2id", "_name_or_path", "transformers_version"):
        data.pop(key, None)
    return data


def save_drafter(
    drafter: DFlashDrafter,
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
        (tmp / CONFIG_NAME).write_text(json.dumps(drafter_config_json(drafter, dtype), indent=2, sort_keys=True))
        for name, text in (extra_files or {}).items():
            (tmp / name).write_text(text)
        replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def load_drafter(path: str | Path, device: str | torch.device = "cpu", dtype: Optional[torch.dtype] = None) -> DFlashDrafter:
    """Load an exported drafter strictly: every tensor name and shape must match the config."""
    path = Path(path)
    cfg_file, weights = path / CONFIG_NAME, path / WEIGHTS_NAME
    for f in (cfg_file, weights):
        if not f.is_file():
            raise FileNotFoundError(f"{f} is missing: {path} is not an exported DFlash drafter")
    try:
        config = drafter_config_from_dict(json.loads(cfg_file.read_text()))
    except (ValueError, json.JSONDecodeError) as e:
        raise ValueError(f"{cfg_file}: {e}") from e
    with torch.device("meta"):
        drafter = DFlashDrafter(config)
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
    drafter = DFlashDrafter(config).to(device=device, dtype=dtype or file_dtype)
    drafter.load_state_dict(state, strict=True)
    return drafter
