"""Setting a rank up before any weights load: its device and process groups, the drafter's attention backend on
that device, the target's shard mesh, the compile cache and workers, the GPU and host memory preflight, the data and
its plan, the step count and (on resume) the data cursor, and the plan's indexing headroom."""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from ...config.schema import Config
from ...data.dataset import plan_batches
from ...data.source import open_training_data
from ...errors import UserError
from ...accel import compile as compile_layer
from ...target.shard import shard_mesh
from ...run.directory import RunDir
from ...run.reporter import Reporter
from ..plan import indexing
from ..plan import preflight
from ..loop.train_loop import RunState
from .rank_checks import Admitted, shard_group_size, target_rank_ids

log = logging.getLogger(__name__)


@dataclass
class RankSetup:
    """A rank after the process group is up and the data is planned, before any weights load."""

    device: torch.device
    backend: object  # drafter.attention_backend resolved on this device, once: the indexing plan's and the drafter's
    role: str  # "drafter" (colocated or split) or "target" (split)
    drafter_group: object  # the drafter ranks' process group in the split placement (None: the default one)
    drafters: int
    compile_cache: Path
    data: object  # data.source.TrainingData
    batching: tuple  # (lengths, token_budget, max_batch_size, seed)
    per_step: int
    epoch0: list  # the first epoch's plan: the warm-up's batch and its batch kinds
    steps_per_epoch: int
    total: int
    state: RunState
    target_mesh: object = None  # target.sharding=fsdp or tp: the target ranks' shard groups (target/shard.py)

    def epochs_left(self) -> range:
        """The epochs whose plans the rest of the run reaches (from the current one, one more for a partial)."""
        return range(self.state.epoch,
                     self.state.epoch + math.ceil((self.total - self.state.step) / self.steps_per_epoch) + 1)


def set_up_rank(cfg: Config, run: RunDir, a: Admitted, ctx, rep: Reporter, fresh_compile_cache: bool) -> RankSetup:
    """The process group and this rank's role, the shard mesh, compile cache and workers, the memory preflight,
    the data and its plan, the step count and the resumed data cursor: everything before weights load."""
    plan = a.plan
    device = ctx.device(plan.device)
    ctx.init(device, alone_too=cfg.target.sharding != "none")
    drafter_group, drafters = None, ctx.world
    if a.layout is not None:
        # Every rank takes part in creating the group; only drafter ranks use it.
        drafter_group = torch.distributed.new_group(list(range(a.layout.drafter_ranks))) \
            if a.layout.drafter_ranks > 1 else None
        drafters = a.layout.drafter_ranks
    role = "target" if a.layout is not None and a.layout.is_target(ctx.rank) else "drafter"
    backend = a.arch.resolve_backend(cfg.drafter.attention_backend, device, a.block_size)
    mesh = None
    if cfg.target.sharding != "none":  # made by every rank (collectively), used by the target ranks
        mesh = shard_mesh(device, target_rank_ids(a.layout, ctx.world), shard_group_size(cfg, a.layout, ctx.world))
    compile_cache = compile_layer.configure_cache(cfg.run.compile_cache_dir, fresh=fresh_compile_cache)
    compile_layer.watch_recompiles()
    # A drafter's attention and loss always compile on a GPU: the workers start while the weights load.
    if device.type == "cuda" and (role == "drafter" or cfg.target.compile):
        workers = compile_layer.start_compile_workers(int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
        log.info("compile workers: %d", workers)
    if a.layout is not None:
        rep.beat_fields["role"] = role
    log.info("rank %d/%d (%s): target %s, layers %s, mask token %d, device %s", ctx.rank, ctx.world, role,
             plan.target_path, plan.layer_ids, plan.mask_token_id, device)
    if device.type == "cuda":
        need_role = "colocated" if a.layout is None else role
        share = preflight.TargetShare.of(plan.target_path, shard_group_size(cfg, a.layout, ctx.world)) \
            if cfg.target.sharding != "none" and need_role != "drafter" else None
        if share is not None and cfg.target.sharding == "tp":
            share.GATHERED_LAYERS = 0  # tensor parallel gathers no weights: a rank holds its slice only
        need, what = preflight.rank_need(cfg, plan.target_path, a.target_config, a.dcfg, plan.layer_ids,
                                         plan.target_dtype, plan.compute_dtype, need_role, a.layout is not None,
                                         share, a.target_fp8_saved_bytes, arch=a.arch)
        preflight.check_gpu(device, need, ctx.rank, what)
    if ctx.is_main:  # rank 0 writes the checkpoints, from a snapshot in host memory
        preflight.check_host_snapshot(preflight.snapshot_need(a.arch, a.dcfg), ctx.rank)
    data = open_training_data(cfg, a.tokenizer, a.block_size, run.root / "rejects.jsonl" if ctx.is_main else None)
    log.info("data: %s", data.describe())
    batching = (data.lengths, cfg.data.token_budget, cfg.data.max_batch_size, cfg.run.seed)
    per_step = drafters * cfg.optim.grad_accum
    epoch0 = plan_batches(*batching, 0)
    steps_per_epoch = len(epoch0) // per_step
    if steps_per_epoch == 0:
        raise ValueError(f"{len(epoch0)} micro-batches per epoch cannot feed {drafters} drafter rank(s) x "
                         f"{cfg.optim.grad_accum} accumulation; add data")
    total = int(math.ceil(cfg.optim.epochs * steps_per_epoch)) if cfg.optim.epochs > 0 else cfg.optim.max_steps
    if cfg.optim.max_steps:
        total = min(total, cfg.optim.max_steps)
    state = RunState()
    if a.resume_from is not None:
        saved = a.resume_from[1]
        state = RunState(saved["step"], saved["epoch"], saved["batch_index"], saved.get("best_val_tau"))
        if state.step > total:
            raise UserError(f"--resume: the run is at step {state.step}, past the {total} steps its config now asks "
                            "for (optim.max_steps / optim.epochs); give a larger optim.max_steps")
    setup = RankSetup(device, backend, role, drafter_group, drafters, compile_cache, data, batching, per_step, epoch0,
                      steps_per_epoch, total, state, mesh)
    check_indexing(cfg, a, setup, rep)
    return setup


def check_indexing(cfg: Config, a: Admitted, r: RankSetup, rep: Reporter) -> None:
    """How far the plan keeps the compiled graphs from 2^31 elements (indexing.py), over the whole run (the
    target's and the drafter's compiled code alike, so that every rank of a split placement decides the same):
    logged and in status.json, with a warning for a plan that crosses it (64-bit kernels, slower)."""
    widths = indexing.compiled_widths(cfg, a.dcfg, a.target_config, r.backend, r.device.type == "cuda")
    o = cfg.objective
    largest = indexing.largest_tensor(widths, *r.batching, r.epochs_left(), o.max_anchors, o.max_anchors_per_batch,
                                      r.backend.blocks_multiple_of, r.data.anchor_positions)
    log.info("%s", largest.describe())
    warning = indexing.over_limit_warning(largest)
    if warning:
        log.warning("%s", warning)
    rep.report(index_largest_elements=largest.elements,
               index_headroom=round(largest.headroom, 2) if largest.elements else None,
               index_64bit_kernels=warning is not None)
