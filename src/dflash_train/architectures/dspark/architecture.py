"""DSpark's `Architecture`: what the registry (`architectures.architecture("dspark")`) resolves."""

from __future__ import annotations

from ..contract import Architecture
from ..family.backend import resolve_backend
from .config import HF_ARCHITECTURE, config_for_run, dspark_config_from_dict, dspark_config_json
from .flops import step_flops
from .memory import step_memory
from .model import DSparkDrafter
from .objective import DSparkObjective
from .onpolicy import DSparkOnPolicyObjective

ARCHITECTURE = Architecture(
    name="dspark",
    hf_architecture=HF_ARCHITECTURE,
    drafter_class=DSparkDrafter,
    config_for_run=config_for_run,
    config_from_dict=dspark_config_from_dict,
    config_json=dspark_config_json,
    resolve_backend=resolve_backend,
    objective=DSparkObjective,
    step_memory=step_memory,
    step_flops=step_flops,
    needs_target_final=True,
    onpolicy_objective=DSparkOnPolicyObjective,
)
