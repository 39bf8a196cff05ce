"""DFlash's `Architecture`: what the registry (`architectures.architecture("dflash")`) resolves."""

from __future__ import annotations

from ..contract import Architecture
from ..family.backend import resolve_backend
from ..family.config import drafter_config_from_dict, drafter_config_json
from ..family.onpolicy import OnPolicyObjective
from .config import HF_ARCHITECTURE, config_for_run
from .model import DFlashDrafter
from .objective import DFlashObjective

ARCHITECTURE = Architecture(
    name="dflash",
    hf_architecture=HF_ARCHITECTURE,
    drafter_class=DFlashDrafter,
    config_for_run=config_for_run,
    config_from_dict=drafter_config_from_dict,
    config_json=drafter_config_json,
    resolve_backend=resolve_backend,
    objective=DFlashObjective,
    onpolicy_objective=OnPolicyObjective,
)
