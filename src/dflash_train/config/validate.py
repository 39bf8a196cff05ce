"""Validating a config before any model loads: the range of every number, the cross-field checks (`validate`),
and the checks at start-up that need the number of ranks (`validate_world`) or the target's config.json
(`validate_against_target`).
"""

from __future__ import annotations

import functools
import typing
from typing import Any, get_args

from ..architectures import registry
from ..errors import ConfigError
from ..numbers import (ALL_IF_ZERO, BLOCK_SIZE, FRACTION, INDEX, NON_NEGATIVE_NUMBER, POSITIVE_INT, POSITIVE_NUMBER,
                      TRAINING_SEED, Rule)
from ..trackers import TRACKERS, tracker_unavailable
from .schema import Config, _sections, config_sections

_COUNT = Rule(int, low=0)
_BELOW_ONE = Rule(float, low=0, high=1, high_open=True)
# The range of every number in the config (each item of a list; null, where allowed, is not checked here).
NUMBER_RULES: dict[str, Rule] = {
    "target.shard_group_size": POSITIVE_INT,
    "drafter.num_draft_layers": POSITIVE_INT,
    "drafter.block_size": BLOCK_SIZE,
    "drafter.target_layer_ids": INDEX,
    "drafter.mask_token_id": INDEX,
    "drafter.intermediate_size": POSITIVE_INT,
    "drafter.num_attention_heads": POSITIVE_INT,
    "drafter.num_key_value_heads": POSITIVE_INT,
    "drafter.head_dim": POSITIVE_INT,
    "drafter.sliding_window": POSITIVE_INT,
    "drafter.output_multiplier": POSITIVE_NUMBER,
    "drafter.final_logit_softcapping": POSITIVE_NUMBER,
    "drafter.draft_vocab_size": Rule(int, low=0, zero="0 = the target's vocabulary"),
    "data.max_length": POSITIVE_INT,
    "data.max_samples": ALL_IF_ZERO,
    "data.token_budget": POSITIVE_INT,
    "data.max_batch_size": POSITIVE_INT,
    "objective.max_anchors": POSITIVE_INT,
    "objective.max_anchors_per_batch": Rule(int, low=0, zero="0 = no cap"),
    "onpolicy.committed_weight": NON_NEGATIVE_NUMBER,
    "onpolicy.rejected_weight": NON_NEGATIVE_NUMBER,
    "onpolicy.decay": Rule(float, low=0, high=1, low_open=True),
    "onpolicy.log_prob_min": Rule(float, high=0, high_open=True),
    "onpolicy.loss_max": POSITIVE_NUMBER,
    "onpolicy.max_blocks": Rule(int, low=0, zero="0 = objective.max_anchors"),
    "objective.gamma": POSITIVE_NUMBER,
    "objective.loss_chunk_size": POSITIVE_INT,
    "objective.acceptance_floor": Rule(float, low=0, high=1, low_open=True),
    "objective.dpace_alpha": FRACTION,
    "objective.distill_weight": FRACTION,
    "objective.distill_temperature": POSITIVE_NUMBER,
    "optim.lr": POSITIVE_NUMBER,
    "optim.weight_decay": NON_NEGATIVE_NUMBER,
    "optim.betas": _BELOW_ONE,
    "optim.eps": POSITIVE_NUMBER,
    "optim.warmup_ratio": _BELOW_ONE,
    "optim.min_lr_ratio": FRACTION,
    "optim.decay_ratio": Rule(float, low=0, high=1, low_open=True),
    "optim.grad_clip": Rule(float, low=0, zero="0 = no clipping"),
    "optim.epochs": Rule(float, low=0, zero="0 = until optim.max_steps"),
    "optim.max_steps": Rule(int, low=0, zero="0 = all optim.epochs"),
    "optim.grad_accum": POSITIVE_INT,
    "run.seed": TRAINING_SEED,
    "run.log_every": POSITIVE_INT,
    "run.save_every": POSITIVE_INT,
    "run.keep_last": POSITIVE_INT,
    "run.eval_every": Rule(int, low=0, zero="0 = off"),
    "run.eval_batches": _COUNT,
    "run.eval_prompts": _COUNT,
    "run.eval_max_new_tokens": POSITIVE_INT,
    "run.mfu_peak_tflops": POSITIVE_NUMBER,
    "parallel.target_ranks": POSITIVE_INT,
}


def number_rules() -> dict[str, Rule]:
    """`NUMBER_RULES` and the ranges of every registered architecture's section (`NAME.key`)."""
    return {**NUMBER_RULES, **{f"{name}.{key}": rule for name, o in _sections().items()
                               for key, rule in o.number_rules.items()}}


def numeric_keys() -> list[str]:
    """Every config key whose value is a number or a list of numbers (optionally null)."""
    keys = []
    for section, section_type in config_sections():
        for name, tp in typing.get_type_hints(section_type).items():
            leaves = {a for a in get_args(tp) if a is not type(None) and a is not Ellipsis} or {tp}
            if any(leaf in (int, float) or set(get_args(leaf)) & {int, float} for leaf in leaves):
                keys.append(f"{section}.{name}")
    return keys


@functools.lru_cache(maxsize=None)
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _check_number(key: str, rule: Rule, value: Any, nullable: bool) -> None:
    items = isinstance(value, (list, tuple))
    for item in value if items else [value]:
        problem = None if item is None else rule.problem(item, or_null=nullable and not items)
        if problem:
            raise ConfigError(f"config key '{key}': {'each item ' if items else ''}{problem}")


def _check_section_numbers(name: str, options: registry.Options, section: Any) -> None:
    hints = _hints(type(section))
    for key, rule in options.number_rules.items():
        _check_number(f"{name}.{key}", rule, getattr(section, key), type(None) in get_args(hints[key]))


def check_numbers(cfg: Config) -> None:
    """Every number of `cfg` inside its `NUMBER_RULES` range (and its architecture section's); the message names
    the key and the range."""
    for key, rule in NUMBER_RULES.items():
        section, name = key.split(".")
        owner = getattr(cfg, section)
        _check_number(key, rule, getattr(owner, name), type(None) in get_args(_hints(type(owner))[name]))
    if cfg.options is not None:
        _check_section_numbers(cfg.drafter.architecture, registry.options(cfg.drafter.architecture), cfg.options)


def validate(cfg: Config) -> None:
    """Cross-field checks that need no model. Target-dependent checks: `validate_against_target`."""

    def need(ok: bool, key: str, msg: str) -> None:
        if not ok:
            raise ConfigError(f"config key '{key}': {msg}")

    check_numbers(cfg)
    d, o, op, dt, r = cfg.drafter, cfg.objective, cfg.optim, cfg.data, cfg.run
    need(d.architecture in registry.names(), "drafter.architecture",
         f"must be one of {', '.join(registry.names())} (got {d.architecture!r})")
    own = registry.options(d.architecture)
    if own.validate is not None:  # the architecture's own cross-checks (its options.py)
        own.validate(cfg)
    if d.target_layer_ids is not None:
        need(len(d.target_layer_ids) >= 1, "drafter.target_layer_ids", "must list at least one layer (or be null)")
        need(len(set(d.target_layer_ids)) == len(d.target_layer_ids), "drafter.target_layer_ids", "ids must be distinct")
    if d.sliding_window is not None:
        need(d.sliding_window > d.block_size, "drafter.sliding_window",
             f"must be > drafter.block_size = {d.block_size} (or null): block slot i sees the sliding_window - 1 - i "
             f"context positions before its anchor, so a window of {d.sliding_window} leaves the last "
             f"{d.block_size - d.sliding_window + 1} slot(s) no context at all")
    if d.fp8_grad_weight != "tensorwise":
        need(d.fp8, "drafter.fp8_grad_weight",
             f"{d.fp8_grad_weight!r} chooses the FP8 drafter's weight-gradient matmul; set drafter.fp8=true too, "
             "or leave drafter.fp8_grad_weight at its default (tensorwise)")
    if o.head_gradient == "keep":
        need(d.draft_vocab_size > 0, "objective.head_gradient",
             "keep is for a trained head (drafter.draft_vocab_size > 0); the target's frozen head has no weight "
             "gradient: leave objective.head_gradient at auto")
    if d.draft_vocab_size:
        capable = [n for n in registry.names() if registry.options(n).draft_vocabulary]
        need(own.draft_vocabulary, "drafter.draft_vocab_size",
             f"a reduced draft vocabulary is implemented for drafter.architecture={' / '.join(capable)} only; "
             f"{d.architecture} scores the target's whole vocabulary: set drafter.draft_vocab_size=0 or "
             f"drafter.architecture={capable[0]}")
        need(o.distill_weight == 0, "drafter.draft_vocab_size",
             "distillation (objective.distill_weight > 0) mixes in the target's distribution over its whole "
             "vocabulary, which a reduced draft vocabulary cannot express: set objective.distill_weight=0 or "
             "drafter.draft_vocab_size=0")
    if d.num_attention_heads and d.num_key_value_heads:
        need(d.num_attention_heads % d.num_key_value_heads == 0, "drafter.num_key_value_heads",
             f"must divide drafter.num_attention_heads={d.num_attention_heads} (got {d.num_key_value_heads})")
    if op.schedule == "wsd":
        need(op.warmup_ratio + op.decay_ratio <= 1, "optim.decay_ratio",
             f"optim.warmup_ratio + optim.decay_ratio must be <= 1 (got {op.warmup_ratio} + {op.decay_ratio})")
    need(op.epochs > 0 or op.max_steps > 0, "optim.epochs", "set epochs > 0 or optim.max_steps > 0")
    need(dt.max_length >= 2 * d.block_size, "data.max_length",
         f"must be >= 2 * drafter.block_size = {2 * d.block_size} (got {dt.max_length})")
    need(dt.token_budget >= dt.max_length, "data.token_budget",
         f"must be >= data.max_length = {dt.max_length} so that every sequence fits (got {dt.token_budget})")
    for name in r.report_to:
        need(name in TRACKERS, "run.report_to", f"{name!r} is not a tracker; valid: {', '.join(TRACKERS)} "
             "(TensorBoard is always written; [] for it alone)")
    need(len(set(r.report_to)) == len(r.report_to), "run.report_to", f"lists a tracker twice ({r.report_to})")
    if r.device == "cpu":
        validate_compile_device(cfg, "cpu")
    validate_sharding(cfg)
    if cfg.onpolicy.start_from:
        validate_onpolicy(cfg)
    if cfg.parallel.placement == "split":
        need(r.eval_every == 0, "run.eval_every",
             "validation during training needs the target on the drafter's rank; with parallel.placement=split set "
             "run.eval_every=0 and evaluate checkpoints with `dflash-train eval`")
        need(o.distill_weight == 0, "objective.distill_weight",
             "distillation needs the target's final hidden states, which the split placement does not send to the "
             "drafter ranks yet; use parallel.placement=colocated or set objective.distill_weight=0")


def validate_onpolicy(cfg: Config) -> None:
    """The on-policy stage's cross-checks (`onpolicy.start_from` set)."""
    def need(ok: bool, key: str, msg: str) -> None:
        if not ok:
            raise ConfigError(f"config key '{key}': {msg}")

    d, op = cfg.drafter, cfg.onpolicy
    capable = [n for n in registry.names() if registry.options(n).on_policy]
    need(registry.options(d.architecture).on_policy, "onpolicy.start_from",
         f"the on-policy stage trains drafter.architecture={' / '.join(capable)}, whose probability of each draft it "
         f"knows; it does not train {d.architecture} yet: leave onpolicy.start_from empty")
    need(d.draft_vocab_size == 0, "drafter.draft_vocab_size",
         "the on-policy stage compares the drafter's and the target's probabilities over the target's vocabulary; "
         "continue a full-vocabulary run (drafter.draft_vocab_size=0)")
    need(d.output_multiplier == 1.0 and not d.final_logit_softcapping, "drafter.output_multiplier",
         "the on-policy stage reads the drafter's plain log-probabilities; leave drafter.output_multiplier and "
         "drafter.final_logit_softcapping at their defaults")
    need(cfg.parallel.placement == "colocated", "parallel.placement",
         "the on-policy stage verifies drafts with the target's logits on the drafter's rank; use "
         "parallel.placement=colocated")
    need(cfg.objective.distill_weight == 0, "objective.distill_weight",
         "the on-policy stage has its own loss; set objective.distill_weight=0")
    need(op.committed_weight + op.rejected_weight > 0, "onpolicy.committed_weight",
         "onpolicy.committed_weight and onpolicy.rejected_weight are both 0: nothing would train; give one a weight")


SHARDINGS = ("none", "fsdp", "tp")


def validate_sharding(cfg: Config) -> None:
    """`target.sharding` and `target.shard_group_size`, and what a sharded target does not support yet."""
    t = cfg.target

    def need(ok: bool, key: str, msg: str) -> None:
        if not ok:
            raise ConfigError(f"config key '{key}': {msg}")

    need(t.sharding in SHARDINGS, "target.sharding", f"must be one of {', '.join(SHARDINGS)} (got {t.sharding!r})")
    if t.sharding == "none":
        need(t.shard_group_size is None, "target.shard_group_size",
             "applies to a sharded target only; set target.sharding=fsdp (or tp) or remove target.shard_group_size")
        return
    # DTensor's sharding rules put the batch size modulo the group size into a compiled layer's guards: a
    # batch of another parity would compile again mid-training (measured on CPU with Dynamo's eager backend).
    need(t.sharding != "tp" or not t.compile, "target.compile",
         "a tensor-parallel target's compiled layers would recompile for every new batch-size parity; set "
         "target.compile=false with target.sharding=tp, or use target.sharding=fsdp")
    need(t.quantize == "none", "target.quantize",
         f"an FP8 target cannot be sharded yet (target.sharding={t.sharding}); set target.quantize=none or "
         "target.sharding=none")


def validate_compile_device(cfg: Config, device_type: str) -> None:
    """`target.compile`, `drafter.compile` and the flex attention backend need a CUDA device to train (run at
    config load for run.device=cpu, and once `auto` resolves)."""
    for key, on, what in (("target.compile", cfg.target.compile, "the target's decoder layers"),
                          ("drafter.compile", cfg.drafter.compile, "the drafter's layers")):
        if on and device_type != "cuda":
            raise ConfigError(
                f"config key '{key}': compiles {what} with inductor for CUDA GPUs, but the run's device is "
                f"{device_type} (run.device={cfg.run.device}); set {key}=false"
            )
    if cfg.drafter.attention_backend == "flex" and device_type != "cuda":
        raise ConfigError(
            f"config key 'drafter.attention_backend': flex needs a CUDA device for training (FlexAttention has no "
            f"CPU backward), but the run's device is {device_type} (run.device={cfg.run.device}); set "
            f"drafter.attention_backend=sdpa (or auto)"
        )


def validate_trackers(cfg: Config) -> None:
    """Each tracker of run.report_to imports here: a missing package fails the start, no silent fallback. Run
    at start-up (by `validate_world`), not by `validate`: a resume loads the run's own config.yaml as it was
    recorded, and must be able to drop a tracker whose package this machine lacks (run.report_to=[])."""
    for name in cfg.run.report_to:
        unavailable = tracker_unavailable(name)
        if unavailable:
            raise ConfigError(unavailable)


def validate_world(cfg: Config, world: int) -> None:
    """Checks at start-up, before any model loads: the number of ranks, and the trackers' packages."""
    validate_trackers(cfg)
    if cfg.parallel.placement == "split" and not 1 <= cfg.parallel.target_ranks < world:
        raise ConfigError(
            f"config key 'parallel.target_ranks': {cfg.parallel.target_ranks} target rank(s) do not fit {world} "
            f"rank(s); the split placement needs at least one target and one drafter rank "
            f"(start more ranks with --nproc, or use parallel.placement=colocated)"
        )
    if cfg.target.sharding != "none":
        validate_shard_groups(cfg, world)


def validate_shard_groups(cfg: Config, world: int) -> None:
    """A sharded target's groups must divide its ranks (all, or the split placement's target ranks); in the split
    placement every target rank captures as many micro-batches per step as its group peers (they all-gather each
    layer together, so they must capture in lockstep)."""
    split = cfg.parallel.placement == "split"
    targets = cfg.parallel.target_ranks if split else world
    what = f"the {targets} target rank(s) (parallel.target_ranks)" if split else f"the run's {world} rank(s)"
    group = cfg.target.shard_group_size
    if group is not None and (group > targets or targets % group):
        raise ConfigError(
            f"config key 'target.shard_group_size': {group} does not divide {what} into shard groups; give a divisor "
            f"of {targets}, or null for one group of all of them"
        )
    per_step = (world - targets) * cfg.optim.grad_accum
    if split and (group or targets) > 1 and per_step % targets:
        raise ConfigError(
            f"config key 'parallel.target_ranks': a sharded target's ranks capture in lockstep, so each step's "
            f"{per_step} micro-batches (drafter ranks x optim.grad_accum) must split evenly over the {targets} target "
            "ranks; change optim.grad_accum or the number of ranks, or set target.shard_group_size=1"
        )


def validate_against_target(cfg: Config, num_target_layers: int, vocab_size: int) -> None:
    """Checks that need only the target's config.json (run before any weights load)."""
    ids = cfg.drafter.target_layer_ids
    if ids is not None and max(ids) >= num_target_layers:
        raise ConfigError(
            f"config key 'drafter.target_layer_ids': {ids} names layer {max(ids)}, but the target has "
            f"{num_target_layers} decoder layers (valid ids 0..{num_target_layers - 1})"
        )
    n = cfg.drafter.draft_vocab_size
    if n > vocab_size:
        raise ConfigError(
            f"config key 'drafter.draft_vocab_size': {n} is larger than the target's vocabulary ({vocab_size} "
            f"tokens); give 1..{vocab_size}, or 0 for the target's whole vocabulary"
        )
    mask = cfg.drafter.mask_token_id
    if mask is not None and mask >= vocab_size:
        raise ConfigError(
            f"config key 'drafter.mask_token_id': {mask} is outside the target's vocabulary (size {vocab_size}); set "
            "it to null for the target's default (its mask token, else its first embedding row no token uses, else a "
            f"reserved token) or to the id, below {vocab_size}, of a special token the model never emits"
        )
