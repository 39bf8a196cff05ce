"""DFlash's `Architecture`: what the registry (`algorithms.architecture("dflash")`) resolves."""

from __future__ import annotations

from ..base import Architecture
from .attention import resolve_backend
from .config import config_for_run, drafter_config_from_dict, drafter_config_json
from .model import DFlashDrafter
from .objective import DFlashObjective

ARCHITECTURE = Architecture(
    name="dflash",
    hf_architecture="DFlashDraftModel",
    drafter_class=DFlashDrafter,
    config_for_run=config_for_run,
    config_from_dict=drafter_config_from_dict,
    config_json=drafter_config_json,
    resolve_backend=resolve_backend,
    objective=DFlashObjective,
)
