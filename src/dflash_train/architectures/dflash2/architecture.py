"""DFlash2's `Architecture`: what the registry (`architectures.architecture("dflash2")`) resolves."""

from __future__ import annotations

from ..contract import Architecture
from ..family.backend import resolve_backend
from .config import HF_ARCHITECTURE, config_for_run, dflash2_config_from_dict, dflash2_config_json
from .flops import step_flops
from .memory import step_memory
from .model import DFlash2Drafter
from .objective import DFlash2Objective
from .onpolicy import DFlash2OnPolicyObjective
from .options import options_of


def parameter_groups(drafter: DFlash2Drafter, cfg) -> list[dict]:
    """The trained parameters at `optim.lr`; the candidate selector in a group of its own when
    `dflash2.selector_lr_scale` is not 1 (the schedule scales every group's rate by the same factor)."""
    scale = options_of(cfg).selector_lr_scale
    named = [(n, p) for n, p in drafter.named_parameters() if p.requires_grad]
    if scale == 1.0:
        return [{"params": [p for _, p in named]}]
    selector = [p for n, p in named if n.startswith("candidate_selector.")]
    rest = [p for n, p in named if not n.startswith("candidate_selector.")]
    return [{"params": rest}, {"params": selector, "lr": cfg.optim.lr * scale}]


ARCHITECTURE = Architecture(
    name="dflash2",
    hf_architecture=HF_ARCHITECTURE,
    drafter_class=DFlash2Drafter,
    config_for_run=config_for_run,
    config_from_dict=dflash2_config_from_dict,
    config_json=dflash2_config_json,
    resolve_backend=resolve_backend,
    objective=DFlash2Objective,
    onpolicy_objective=DFlash2OnPolicyObjective,
    parameter_groups=parameter_groups,
    step_memory=step_memory,
    step_flops=step_flops,
)
