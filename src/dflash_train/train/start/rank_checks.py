"""A rank's admission of its start: every check that needs no weights (the config against the target's
config.json and tokenizer, the FP8 and tensor-parallel shapes, on resume the checkpoint that matches this setup),
before the run directory is touched; then rank 0 takes the directory over. The supervisor's admission (may this
command use its run directory at all) is `directory_admission.py`."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from ... import assets
from ...config.load import dump_config
from ...config.schema import Config
from ...config.validate import validate_against_target, validate_compile_device, validate_world
from ...data.source import require_label_counts
from ...errors import UserError
from ...architectures import architecture
from ...architectures.contract import Architecture
from ...architectures.drafter import default_target_layer_ids
from ...target.provenance import target_provenance
from ...target.tensor_parallel import check_tp_target
from ...target.capture import default_mask_token_id, load_tokenizer, read_target_config
from ...run.directory import RunDir, clear_stop_request, stop_requested_since
from ..loop.stop import launch_time
from ...runtime import resolve_device, resolve_dtype
from .. import checkpoint as checkpoints
from .directory_admission import holds_run_message
from ..plan.fp8_plan import check_fp8_device, check_fp8_shapes, fp8_target_layers
from ..split.transport import SplitLayout
from .stage_start import check_stage_start

log = logging.getLogger(__name__)


@dataclass
class Plan:
    """Everything decided before weights load."""

    target_path: Path
    layer_ids: list[int]
    mask_token_id: int
    device: torch.device
    target_dtype: torch.dtype
    compute_dtype: torch.dtype
    target_fp8_layers: int = 0  # target.quantize=fp8: decoder layers 0..n-1 load in FP8


def plan_run(cfg: Config, arch: Architecture) -> tuple[Plan, object]:
    """Resolve the target and check the config against its config.json and tokenizer; no weights load. `arch`:
    the run's architecture (`admit` resolves it)."""
    target_path = assets.resolve_target(cfg.target.path)
    tcfg = read_target_config(target_path, cfg.target.trust_remote_code)
    validate_against_target(cfg, tcfg.num_hidden_layers, tcfg.vocab_size)
    layer_ids = cfg.drafter.target_layer_ids or default_target_layer_ids(
        tcfg.num_hidden_layers, cfg.drafter.num_draft_layers
    )
    tokenizer = load_tokenizer(target_path, cfg.target.trust_remote_code)
    mask = cfg.drafter.mask_token_id
    if mask is None:
        mask = default_mask_token_id(tokenizer, assets.target_defaults(target_path).get("mask_token_id_suggestion"),
                                     tcfg.vocab_size)
    forbidden = {tokenizer.pad_token_id: "pad", tokenizer.eos_token_id: "eos"}
    if mask in forbidden:
        raise ValueError(
            f"drafter.mask_token_id={mask} is the tokenizer's {forbidden[mask]} token; the drafter must see a token "
            "that never appears in normal text: leave drafter.mask_token_id at null for the target's default"
        )
    device = resolve_device(cfg.run.device)
    validate_compile_device(cfg, device.type)  # target/drafter.compile: CUDA only (auto may resolve to cpu)
    target_dtype = resolve_dtype(cfg.target.dtype, device)
    compute_dtype = resolve_dtype(cfg.run.dtype, device)
    check_fp8_device(cfg, device, target_dtype, compute_dtype)
    fp8_layers = fp8_target_layers(cfg, layer_ids, tcfg.num_hidden_layers, arch)
    return Plan(target_path, layer_ids, int(mask), device, target_dtype, compute_dtype, fp8_layers), tokenizer


@dataclass
class Admitted:
    """What a rank knows before it writes anything: the split layout, the resolved plan and tokenizer, the
    architecture (resolved once here from `drafter.architecture`: the rest of the start takes this object) and
    the drafter's config, what it trains against, and (on resume) the checkpoint that matches this setup."""

    layout: Optional[SplitLayout]
    plan: Plan
    tokenizer: object
    target_config: object
    arch: Architecture
    dcfg: object
    provenance: dict
    identity: dict
    placement: str
    resume_from: Optional[tuple[Path, dict]]
    target_fp8_saved_bytes: int = 0  # target.quantize=fp8: what the quantised linears save (preflight)

    @property
    def block_size(self) -> int:
        """The drafter's block size, from its config: the one the objective and decoding read too."""
        return self.dcfg.block_size


DRAFTER_SHAPE = ("num_hidden_layers", "hidden_size", "intermediate_size", "block_size", "num_attention_heads",
                 "num_key_value_heads", "head_dim")


def admit(cfg: Config, run: RunDir, world: int, is_main: bool, resume: bool) -> Admitted:
    """Every check that needs no weights, before the run directory is touched: a refused start (a config
    that does not fit the target, a checkpoint of another setup) leaves the directory byte-identical."""
    validate_world(cfg, world)
    if is_main and not resume and run.root.is_dir() and run.contents(own_launch=launch_time()):
        raise UserError(holds_run_message(run))
    layout = SplitLayout(world, cfg.parallel.target_ranks, cfg.optim.grad_accum) \
        if cfg.parallel.placement == "split" else None
    arch = architecture(cfg.drafter.architecture)
    plan, tokenizer = plan_run(cfg, arch)
    require_label_counts(cfg)  # a reduced draft vocabulary is chosen from the prepared data's label counts
    target_config = read_target_config(plan.target_path, cfg.target.trust_remote_code)
    if cfg.target.sharding == "tp":  # heads and MLP width must split over the group: refused before any load
        check_tp_target(target_config, shard_group_size(cfg, layout, world))
    dcfg = arch.config_for_run(target_config, cfg, plan.layer_ids, plan.mask_token_id)
    fp8_saved = check_fp8_shapes(cfg, plan.target_path, plan.target_fp8_layers, plan.target_dtype, dcfg, arch)
    if cfg.onpolicy.start_from and not resume:  # the finished run's drafter must be this stage's (a resumed stage
        check_stage_start(cfg.onpolicy.start_from, dcfg, arch.name)  # reads its own checkpoint, not that export)
    named = assets.target_identity(cfg.target.path, plan.target_path)  # what names it on another machine too
    provenance = target_provenance(named, tokenizer, target_config)
    placement = "colocated" if layout is None else f"split {layout.target_ranks}+{layout.drafter_ranks}"
    identity = {"world_size": world, "placement": placement, "grad_accum": cfg.optim.grad_accum,
                "tokenizer_sha256": provenance["tokenizer_sha256"],
                "drafter_shape": [getattr(dcfg, k) for k in DRAFTER_SHAPE],
                "target_layer_ids": list(plan.layer_ids), "mask_token_id": plan.mask_token_id,
                "target_layers": provenance["num_hidden_layers"]}
    resume_from = None
    if resume:
        ckpt = checkpoints.newest_valid(run.checkpoints)
        if ckpt is None:
            raise UserError(f"--resume: no usable checkpoint in {run.checkpoints}")
        state = checkpoints.read_state(ckpt)
        checkpoints.check_compatible(ckpt, state, identity, {"drafter_shape": DRAFTER_SHAPE})
        resume_from = (ckpt, state)
    return Admitted(layout, plan, tokenizer, target_config, arch, dcfg, provenance, identity, placement, resume_from,
                    fp8_saved)


def take_over(run: RunDir, cfg: Config, changes: Optional[dict], since: float) -> None:
    """Rank 0 of an admitted start makes the run directory its own: the config it runs, the changes a resume
    made (logged and appended to resumes.jsonl), and no stale stop request."""
    dump_config(cfg, run.config)
    if changes:
        for key, (before, after) in changes.items():
            log.warning("--resume changes %s: %r -> %r", key, before, after)
        with open(run.root / "resumes.jsonl", "a") as f:
            f.write(json.dumps({"time": time.time(), "changes": {k: list(v) for k, v in changes.items()}}) + "\n")
    if run.stop_file.exists() and not stop_requested_since(run, since):
        log.info("removed a stale stop request (%s), written before this start", run.stop_file)
        clear_stop_request(run)


def target_rank_ids(layout: Optional[SplitLayout], world: int) -> list[int]:
    """The ranks that run the target: all (colocated), or the split placement's last ones."""
    return list(range(world)) if layout is None else list(range(layout.drafter_ranks, world))


def shard_group_size(cfg: Config, layout: Optional[SplitLayout], world: int) -> int:
    """The target ranks that share one copy of a sharded target (`target.shard_group_size`, null = all of them)."""
    return cfg.target.shard_group_size or len(target_rank_ids(layout, world))
