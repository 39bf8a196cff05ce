"""LiLiCorr's `Architecture`: what the registry (`architectures.architecture("lilicorr")`) resolves."""

from __future__ import annotations

from ..contract import Architecture
from ..family.backend import resolve_backend
from .config import HF_ARCHITECTURE, config_for_run, lilicorr_config_from_dict, lilicorr_config_json
from .flops import step_flops
from .memory import step_memory
from .model import LiLiCorrDrafter
from .objective import LiLiCorrObjective
from .onpolicy import LiLiCorrOnPolicyObjective

ARCHITECTURE = Architecture(
    name="lilicorr",
    hf_architecture=HF_ARCHITECTURE,
    drafter_class=LiLiCorrDrafter,
    config_for_run=config_for_run,
    config_from_dict=lilicorr_config_from_dict,
    config_json=lilicorr_config_json,
    resolve_backend=resolve_backend,
    objective=LiLiCorrObjective,
    step_memory=step_memory,
    step_flops=step_flops,
    needs_target_final=True,
    onpolicy_objective=LiLiCorrOnPolicyObjective,
)
