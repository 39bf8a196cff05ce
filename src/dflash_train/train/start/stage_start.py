"""The on-policy stage's start (`onpolicy.start_from`): the finished run's exported drafter, checked against the
stage's drafter config before any weight loads, and its weights loaded into the stage's drafter (a resume loads the
stage's own checkpoint instead)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ...architectures import architecture_of_export, registry
from ...architectures.io import load_drafter
from ...errors import ConfigError

KEY = "onpolicy.start_from"
# The drafter config's fields that fix its tensors' shapes and what they mean: the stage's must equal the export's.
SHAPE_FIELDS = ("hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                "head_dim", "block_size", "vocab_size")
DFLASH_FIELDS = ("target_layer_ids", "mask_token_id")


def export_folder(start_from: str) -> Path:
    """The exported drafter `start_from` names: the folder itself, or a run directory's `export/`."""
    path = Path(start_from).expanduser()
    for folder in (path, path / "export"):
        if (folder / "config.json").is_file() and (folder / "model.safetensors").is_file():
            return folder
    raise ConfigError(f"config key '{KEY}': {path} holds no exported drafter (config.json and model.safetensors, or a "
                      "run directory with export/); give a finished run's directory, or export one of its checkpoints "
                      "first (dflash-train export RUN/checkpoints/step-N --out DIR)")


def check_stage_start(start_from: str, dcfg, architecture_name: str) -> Path:
    """The export `start_from` names, refused (naming the key and what differs) unless it is a drafter of the
    stage's architecture and shape: `dcfg` is the stage's drafter config."""
    folder = export_folder(start_from)
    try:
        data = json.loads((folder / "config.json").read_text(encoding="utf-8"))
        member = architecture_of_export(data)
        found = member.name
        theirs = member.config_from_dict(data)  # the member's own layout of its fields, read back
    except (OSError, ValueError) as e:
        raise ConfigError(f"config key '{KEY}': {folder / 'config.json'} is not a readable drafter config ({e})") \
            from None
    if found != architecture_name:
        raise ConfigError(f"config key '{KEY}': {folder} holds a {found} drafter and this stage trains "
                          f"drafter.architecture={architecture_name}; set drafter.architecture={found} (and its run's "
                          "drafter keys)")
    own, stage = theirs.dflash_config, dcfg.dflash_config
    differs = [(k, getattr(theirs, k, None), getattr(dcfg, k, None)) for k in SHAPE_FIELDS
               if getattr(theirs, k, None) != getattr(dcfg, k, None)]
    shared = [k for k in own if k in stage and k not in DFLASH_FIELDS]  # the member's own fields both configs have
    differs += [(k, own.get(k), stage.get(k)) for k in (*DFLASH_FIELDS, *shared) if own.get(k) != stage.get(k)]
    if differs:
        k, theirs, ours = differs[0]
        raise ConfigError(f"config key '{KEY}': the drafter in {folder} has {k} {theirs} where this stage's drafter "
                          f"config gives {ours}; give the stage the finished run's drafter and target keys (its "
                          f"config.yaml){' (and ' + str(len(differs) - 1) + ' more)' if len(differs) > 1 else ''}")
    if not registry.options(architecture_name).on_policy:  # validate() refused it already; a direct call too
        raise ConfigError(f"config key '{KEY}': the on-policy stage does not train {architecture_name}")
    return folder


@torch.no_grad()
def load_stage_start(drafter: torch.nn.Module, start_from: str) -> Path:
    """The export's weights into `drafter` (float32 master weights stay float32); every tensor must match."""
    folder = export_folder(start_from)
    state = load_drafter(folder).state_dict()
    drafter.load_state_dict({k: v.to(drafter.state_dict()[k].dtype) for k, v in state.items()}, strict=True)
    return folder
