"""What the registry resolves a `drafter.architecture` to (`Architecture`), and the hooks it holds besides its
drafter: its training objective (`Objective`), its own terms in the step's activation estimate (`StepMemory`) and
in its model FLOPs (`StepFlops`), its optimizer's parameter groups. The generic code never imports an
architecture's package; it asks the registry (`architectures.architecture(name)`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional, Protocol

import torch

from .drafter import Drafter
from .stats import DraftWork, StepStats

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from ..config.schema import Config
    from ..data.batch import Batch


class Objective(Protocol):
    """An architecture's training objective on one micro-batch, graph kept for backward. `generator` draws
    the anchors; `call` runs the drafter's forward (its DDP wrapper on several ranks); `hidden` is the
    target's capture when another rank computed it. An objective whose loss changes over the run may also have
    `begin_step(step, total_steps)`, which the training step calls before each step's micro-batches."""

    def __call__(self, batch: "Batch", generator: torch.Generator, call: Optional[Callable] = None,
                 hidden: Optional[torch.Tensor] = None) -> StepStats: ...

    def describe(self) -> str:
        """What it optimises, in words, for the run's log."""
        ...


@dataclass(frozen=True)
class StepMemory:
    """An architecture's own terms in the drafter step's activation estimate (train/plan/activation_memory.py
    `drafter_step_parts`), beside the generic ones every block drafter's step has (its layers, the lm_head + CE
    chunk); all zero here. `e` is the compute dtype's bytes. An architecture with more overrides these from its
    drafter config (`Architecture.step_memory`)."""

    def ce_chunk_per_class(self, e: int, compiled: bool) -> int:
        """Bytes more per [row, class] of one lm_head + CE chunk (`compiled`: its math fused, on a GPU)."""
        return 0

    def head_columns(self) -> int:
        """Columns the loss appends to its compute-dtype copy of the head `[classes, H]` for its product (a table
        of its own scored beside the head), 0 where it uses the head as it is."""
        return 0

    def layer_per_query(self, hidden: int) -> int:
        """Values (compute dtype) more that one drafter layer saves for its backward, per query token."""
        return 0

    def on_top(self, counted: int, head_classes: int, e: int) -> dict[str, int]:
        """Named parts that run on top of every layer's saved activations (the estimate counts the largest of
        these and the generic ones: the lm_head + CE chunk, one layer's backward), over `counted` rows."""
        return {}

    def loss_rows(self, counted: int, e: int) -> int:
        """Bytes more the loss keeps for its `counted` rows until the backward (`e`: the compute dtype's bytes)."""
        return 0


def one_parameter_group(drafter: Drafter, cfg: "Config") -> list[dict]:
    """Every trained parameter at `optim.lr` (the default `Architecture.parameter_groups`)."""
    return [{"params": [p for p in drafter.parameters() if p.requires_grad]}]


def no_step_memory(drafter_config: "PretrainedConfig") -> StepMemory:
    return StepMemory()


@dataclass(frozen=True)
class StepFlops:
    """An architecture's own modules in the model FLOPs of a training step (train/loop/flops.py `drafter_flop_parts`),
    beside the generic ones every block drafter's step has (fc, layers, attention, the vocabulary head); none here.
    An architecture with more overrides `parts` from its drafter config (`Architecture.step_flops`)."""

    def parts(self, work: DraftWork) -> dict[str, float]:
        """Named useful FLOPs, forward + backward, of the modules of its own over a step's (or a micro-batch's)
        drafter work (`DraftWork`: blocks, block tokens, counted rows, target positions)."""
        return {}


def no_step_flops(drafter_config: "PretrainedConfig") -> StepFlops:
    return StepFlops()


@dataclass(frozen=True)
class Architecture:
    """What the registry resolves a `drafter.architecture` to. The run's config reaches an architecture whole
    (`Config`): its own section, when it declares one (`registry.Options`), is `cfg.options`."""

    name: str  # the `drafter.architecture` value
    hf_architecture: str  # `architectures[0]` of its exported config.json
    drafter_class: Callable[["PretrainedConfig"], Drafter]
    # (target config, the run's config, target layer ids, mask token id) -> drafter config
    config_for_run: Callable[..., "PretrainedConfig"]
    config_from_dict: Callable[[dict], "PretrainedConfig"]  # an exported config.json -> drafter config
    config_json: Callable[[Drafter, str], dict]  # (drafter, dtype name) -> the config.json it exports
    resolve_backend: Callable[..., Any]  # (requested, device, block_size, training) -> attention backend
    objective: Callable[[Drafter, Any, Any, "Config", torch.dtype], Objective]  # (drafter, target, backend, cfg, dtype)
    # (drafter, cfg) -> AdamW's parameter groups (a group may set its own "lr"; the schedule scales every group's)
    parameter_groups: Callable[[Drafter, "Config"], list[dict]] = one_parameter_group
    # the drafter config -> its terms in the step's activation estimate (train/plan/activation_memory.py)
    step_memory: Callable[["PretrainedConfig"], StepMemory] = no_step_memory
    # the drafter config -> its own modules' FLOPs in the step's model FLOPs and MFU (train/loop/flops.py)
    step_flops: Callable[["PretrainedConfig"], StepFlops] = no_step_flops
    # Whether its objective reads the target's final normed hidden states (target.capture(..., with_final=True)):
    # the step's memory estimate then counts them and their counted rows, as it does for distillation.
    needs_target_final: bool = False
    # The on-policy stage's objective (`onpolicy.start_from`; `family/onpolicy.py`, with the member's q), where its
    # options declare `on_policy`: (drafter, target, backend, cfg, dtype) -> Objective.
    onpolicy_objective: Optional[Callable[[Drafter, Any, Any, "Config", torch.dtype], Objective]] = None
