"""Domino's `Architecture`: what the registry (`architectures.architecture("domino")`) resolves."""

from __future__ import annotations

from ..contract import Architecture
from ..family.backend import resolve_backend
from .config import HF_ARCHITECTURE, config_for_run, domino_config_from_dict, domino_config_json
from .flops import step_flops
from .memory import step_memory
from .model import DominoDrafter
from .objective import DominoObjective
from .onpolicy import DominoOnPolicyObjective

ARCHITECTURE = Architecture(
    name="domino",
    hf_architecture=HF_ARCHITECTURE,
    drafter_class=DominoDrafter,
    config_for_run=config_for_run,
    config_from_dict=domino_config_from_dict,
    config_json=domino_config_json,
    resolve_backend=resolve_backend,
    objective=DominoObjective,
    step_memory=step_memory,
    step_flops=step_flops,
    onpolicy_objective=DominoOnPolicyObjective,
)
