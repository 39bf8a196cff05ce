"""One rank's whole run: admit the start (every check that needs no weights, before anything is written),
set the rank up (process group, data plan, preflight), build the target and the drafter, continue from a
checkpoint on resume, warm up, then the training loop (`loop.py`) or, on a split target rank, serve hidden
states. The run directory tells at any moment what is happening (`run.reporter.Reporter`)."""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import torch

from .. import assets
from ..config.load import dump_config
from ..config.schema import Config
from ..config.validate import validate_against_target, validate_compile_device, validate_world
from ..data.batch import Batch, collate
from ..data.dataset import plan_batches
from ..data.label_counts import coverage, draft_vocabulary
from ..data.source import open_training_data, open_validation_data, require_label_counts
from ..errors import UserError, debug_enabled, is_user_error
from ..accel import compile as compile_layer
from ..algorithms import architecture
from ..algorithms.base import default_target_layer_ids
from ..algorithms.init_from_target import init_drafter_from_target
from ..accel.fp8_training import use_fp8_training
from ..target.provenance import serving_record, target_provenance, write_provenance
from ..target.shard import SHARD_DIM, load_sharded_target, peak_host_gib, shard_mesh
from ..target.tensor_parallel import check_tp_target, load_tp_target
from ..target.capture import (TargetCapture, default_mask_token_id, load_target_head, load_target_model, load_tokenizer,
                            read_target_config)
from ..model_card import training_card
from ..run.directory import RunDir, clear_stop_request, stop_requested_since
from ..run.reporter import Reporter
from ..runtime import resolve_device, resolve_dtype, write_text_atomic
from . import checkpoint as checkpoints
from . import indexing, preflight, size_classes
from .admission import flatten, holds_run_message, with_step_cap
from .dist import DistContext
from .fp8_plan import check_fp8_device, check_fp8_shapes, fp8_target_layers
from .launch import LAUNCH_TIME_ENV
from .loop import RunState, Session, memory_gib, micro_batch_groups, train_loop
from .step import TrainStep
from .transport import SplitLayout, TargetOutbox, DrafterInbox
from .validate import evaluating, validation_batches_to_warm_up, validation_loss

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


def plan_run(cfg: Config) -> tuple[Plan, object]:
    """Resolve the target and check the config against its config.json and tokenizer; no weights load."""
    target_path = assets.resolve_target(cfg.target.path)
    tcfg = read_target_config(target_path, cfg.target.trust_remote_code)
    validate_against_target(cfg, tcfg.num_hidden_layers, tcfg.vocab_size)
    layer_ids = cfg.drafter.target_layer_ids or default_target_layer_ids(
        tcfg.num_hidden_layers, cfg.drafter.num_draft_layers
    )
    tokenizer = load_tokenizer(target_path, cfg.target.trust_remote_code)
    mask = cfg.drafter.mask_token_id
    if mask is None:
        mask = default_mask_token_id(tokenizer, assets.target_defaults(target_path).get("mask_token_id_suggestion"))
    forbidden = {tokenizer.pad_token_id: "pad", tokenizer.eos_token_id: "eos"}
    if mask in forbidden:
        raise ValueError(
            f"drafter.mask_token_id={mask} is the tokenizer's {forbidden[mask]} token; the drafter must see a token "
            "that never appears in normal text"
        )
    device = resolve_device(cfg.run.device)
    validate_compile_device(cfg, device.type)  # target/drafter.compile: CUDA only (auto may resolve to cpu)
    target_dtype = resolve_dtype(cfg.target.dtype, device)
    compute_dtype = resolve_dtype(cfg.run.dtype, device)
    check_fp8_device(cfg, device, target_dtype, compute_dtype)
    fp8_layers = fp8_target_layers(cfg, layer_ids, tcfg.num_hidden_layers)
    return Plan(target_path, layer_ids, int(mask), device, target_dtype, compute_dtype, fp8_layers), tokenizer


def _other_batch_size(batch: Batch, hidden: Optional[torch.Tensor]) -> tuple[Batch, Optional[torch.Tensor]]:
    """A batch of the other kind than `batch` for the warm-up: Dynamo specialises a size of 1, so batches of
    one row and of several compile separate graphs. One row (trimmed to its length), or the row twice."""
    if batch.input_ids.shape[0] >= 2:
        n = int(batch.lengths[0])
        return (Batch(batch.input_ids[:1, :n], batch.loss_mask[:1, :n], batch.lengths[:1]),
                None if hidden is None else hidden[:1, :n])
    return (Batch(batch.input_ids.repeat(2, 1), batch.loss_mask.repeat(2, 1), batch.lengths.repeat(2)),
            None if hidden is None else hidden.repeat(2, 1, 1))


def batch_kinds(planned: list[list[int]]) -> tuple[bool, bool]:
    """(one-row batches, batches of several rows) in an epoch's plan: Dynamo compiles the two apart, so a
    warm-up compiles what the data has (one kind costs half the compile time)."""
    rows = {len(b) for b in planned}
    return min(rows) == 1, max(rows) > 1


def warm_up(train_step: TrainStep, batch, cache_dir: Path, validation: Sequence[tuple[int, Batch]] = (),
            hidden: Optional[torch.Tensor] = None, kinds: tuple[bool, bool] = (True, True),
            extremes: tuple = ()) -> dict:
    """Compile everything the loop will run, exactly as the loop runs it (grad on, forward + backward,
    production dtype, dynamic shapes, the batch kinds of `batch_kinds`), then seal the compile layer.
    `extremes`: the plan's batches at the edges of its sizes (`size_classes.warm_up_batches`), run after the
    first so that any variant they need compiles here (the number that did is reported: 0 means the first
    batch's graphs serve the whole plan). `validation`: (index, batch) of the validation batches at the edges
    of validation's sizes (`validate.validation_batches_to_warm_up`), run as validation runs them (no grad,
    eval mode, their own anchors: `validate.validation_loss`). From the start an eager flex_attention call
    raises. Weights do not change. `cache_dir`: where `compile.configure_cache` pointed inductor (reported)."""
    t0 = time.time()
    compile_layer.begin_warm_up()
    # target.compile: the target's layers first, batch 1 and >= 2, lengths near the first batch's (no-op when off)
    target_info = train_step.target.warm_up(batch.input_ids.shape[1], *kinds) \
        if isinstance(train_step.target, TargetCapture) else {}
    graphs = compile_layer.graphs_compiled()
    batches = [(batch, hidden), _other_batch_size(batch, hidden)] if all(kinds) else [(batch, hidden)]
    if hidden is not None:  # a split drafter rank: stand-in captures of the shapes a target rank sends
        extremes = [(e, torch.randn(*e.input_ids.shape, hidden.shape[-1], dtype=hidden.dtype, device=hidden.device))
                    for e in extremes]
    else:
        extremes = [(e, None) for e in extremes]
    first_graphs = None
    for n, (b, h) in enumerate(batches + extremes):
        if n == len(batches):
            first_graphs = compile_layer.graphs_compiled()
        stats = train_step.objective(b, torch.Generator().manual_seed(0), hidden=h)
        stats.loss.backward()
        train_step.optimizer.zero_grad(set_to_none=True)
    training_graphs = compile_layer.graphs_compiled()
    with evaluating(train_step.drafter):
        for index, b in validation:
            validation_loss(train_step, b, index)
    if batch.input_ids.is_cuda:
        torch.cuda.current_stream().synchronize()  # not the NCCL stream: it may hold posted receives
    compile_layer.seal()
    info = {"warmup_s": round(time.time() - t0, 2), "compile_cache_dir": str(cache_dir), **compile_layer.cache_stats(),
            "drafter_compiled_graphs": compile_layer.graphs_compiled() - graphs, **target_info}
    if extremes:
        info["warmup_extreme_batches"] = len(extremes)
        info["extreme_batches_compiled_graphs"] = training_graphs - first_graphs
        if info["extreme_batches_compiled_graphs"]:
            log.warning("warm-up: the plan's extreme batches compiled %d graph(s) the first batch's did not (a size "
                        "threshold in the compiled code; the recompile lines above name the guard); compiled now, "
                        "not mid-run", info["extreme_batches_compiled_graphs"])
    if validation:
        info["warmup_validation_batches"] = len(validation)
        info["validation_compiled_graphs"] = compile_layer.graphs_compiled() - training_graphs
    log.info("warm-up done in %.1f s (compile cache %s: %d hits, %d misses)", info["warmup_s"], cache_dir,
             info["fxgraph_cache_hit"], info["fxgraph_cache_miss"])
    return info


class StoppedDuringStartUp(Exception):
    """SIGTERM / SIGINT before the training loop: nothing to checkpoint, so stop at once."""


class StopRequest:
    """SIGTERM / SIGINT / a STOP file written since this start was launched (an older one is stale). During
    start-up (loading, warm-up) a signal stops the rank at once; once `training()` is called it means:
    finish the step, checkpoint, exit cleanly."""

    def __init__(self, run: RunDir, since: float):
        self.run, self.since, self.signalled, self.in_loop = run, since, False, False
        self._old = {}

    def __enter__(self) -> "StopRequest":
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def training(self) -> None:
        self.in_loop = True

    def _handle(self, signum, _frame) -> None:
        self.signalled = True
        if not self.in_loop:
            raise StoppedDuringStartUp(f"signal {signum} during start-up")
        log.warning("signal %d received: finishing this step, then checkpoint and exit", signum)

    def __exit__(self, *exc) -> None:
        for sig, handler in self._old.items():
            signal.signal(sig, handler)
        self._old = {}

    @property
    def requested(self) -> bool:
        return self.signalled or stop_requested_since(self.run, self.since)


def launch_time() -> float:
    """When this start was launched: the launcher's time (DFLASH_LAUNCH_TIME, inherited by its ranks), else
    now. A STOP file older than this is stale."""
    return float(os.environ.get(LAUNCH_TIME_ENV) or time.time())


@dataclass
class Admitted:
    """What a rank knows before it writes anything: the split layout, the resolved plan and tokenizer, the
    drafter's config, what it trains against, and (on resume) the checkpoint that matches this setup."""

    layout: Optional[SplitLayout]
    plan: Plan
    tokenizer: object
    target_config: object
    dcfg: object
    provenance: dict
    identity: dict
    placement: str
    resume_from: Optional[tuple[Path, dict]]
    target_fp8_saved_bytes: int = 0  # target.quantize=fp8: what the quantised linears save (preflight)


DRAFTER_SHAPE = ("num_hidden_layers", "hidden_size", "intermediate_size", "block_size", "num_attention_heads",
                 "num_key_value_heads", "head_dim")


def admit(cfg: Config, run: RunDir, world: int, is_main: bool, resume: bool) -> Admitted:
    """Every check that needs no weights, before the run directory is touched: a refused start (a config
    that does not fit the target, a checkpoint of another setup) leaves the directory byte-identical."""
    validate_world(cfg, world)
    if is_main and not resume and run.root.is_dir() and run.contents():
        raise UserError(holds_run_message(run))
    layout = SplitLayout(world, cfg.parallel.target_ranks, cfg.optim.grad_accum) \
        if cfg.parallel.placement == "split" else None
    plan, tokenizer = plan_run(cfg)
    require_label_counts(cfg)  # a reduced draft vocabulary is chosen from the prepared data's label counts
    target_config = read_target_config(plan.target_path, cfg.target.trust_remote_code)
    if cfg.target.sharding == "tp":  # heads and MLP width must split over the group: refused before any load
        check_tp_target(target_config, shard_group_size(cfg, layout, world))
    d = cfg.drafter
    dcfg = architecture(d.architecture).config_for_run(target_config, cfg, plan.layer_ids, plan.mask_token_id)
    fp8_saved = check_fp8_shapes(cfg, plan.target_path, plan.target_fp8_layers, plan.target_dtype, dcfg)
    provenance = target_provenance(str(plan.target_path), tokenizer, target_config)
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
    return Admitted(layout, plan, tokenizer, target_config, dcfg, provenance, identity, placement, resume_from,
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


def train(cfg: Config, run_root: Path, max_steps: Optional[int] = None, fresh_compile_cache: bool = False,
          resume: bool = False, changes: Optional[dict] = None, launched_at: Optional[float] = None) -> Optional[Path]:
    """One rank of a run (world size 1 = a single process): admit the start, set the rank up, train
    (`loop.train_loop`) or, in the split placement, serve hidden states as a target rank. Rank 0 owns status,
    metrics, checkpoints. Returns the export folder (done), the checkpoints folder (stopped), or None
    (stopped during start-up, or a target rank's end). `changes`: what a resume changed against the run's
    config (admission.py); `launched_at`: when the command that started it was launched (a STOP file older
    than that is stale)."""
    ctx = DistContext.from_env()
    run = RunDir(run_root)
    cfg = with_step_cap(cfg, max_steps)
    since = launched_at or launch_time()
    stop = StopRequest(run, since).__enter__()  # first: a signal during start-up must not leave a live-looking run
    try:
        admitted = admit(cfg, run, ctx.world, ctx.is_main, resume)  # reads only: a refused start writes nothing
    except StoppedDuringStartUp as e:
        stop.__exit__()
        log.warning("rank %d stopped before it started (%s); nothing was written", ctx.rank, e)
        return None
    except BaseException:
        stop.__exit__()
        raise
    run.create()
    rep = Reporter(run, ctx.rank, ctx.is_main)
    if ctx.is_main:
        take_over(run, cfg, changes, since)
    try:
        rep.report(phase="loading")
        rank = set_up_rank(cfg, run, admitted, ctx, rep, fresh_compile_cache)
        if rank.role == "target":
            run_target_rank(cfg, admitted, rank, rep, stop)
            return None
        session = build_drafter_rank(cfg, run, admitted, rank, rep, ctx, resume)
        warm = warm_up_drafter_rank(session, admitted, rank, rep)
        rep.report(phase="training", step=rank.state.step, total_steps=rank.total,
                   drafter_params=sum(p.numel() for p in session.train_step.drafter.parameters()),
                   backend=session.train_step.backend.name, world_size=ctx.world, placement=admitted.placement, **warm)
        stop.training()
        return train_loop(session, rank.state, rep, stop)
    except StoppedDuringStartUp as e:
        rep.stopped_during_start_up(e)
        log.warning("rank %d stopped during %s (%s)", ctx.rank, rep.phase, e)
        return None
    except BaseException as e:
        rep.failed(e)
        # A user's mistake is one line (its traceback is in status.json); anything else keeps its traceback.
        log.error("rank %d failed: %s", ctx.rank, e, exc_info=not is_user_error(e) or debug_enabled())
        raise
    finally:
        stop.__exit__()
        if ctx.is_main:
            clear_stop_request(run)  # consumed: honoured, or too late to matter; never left for a later start
        rep.close()
        ctx.close()


@dataclass
class RankSetup:
    """A rank after the process group is up and the data is planned, before any weights load."""

    device: torch.device
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


def target_rank_ids(layout: Optional[SplitLayout], world: int) -> list[int]:
    """The ranks that run the target: all (colocated), or the split placement's last ones."""
    return list(range(world)) if layout is None else list(range(layout.drafter_ranks, world))


def shard_group_size(cfg: Config, layout: Optional[SplitLayout], world: int) -> int:
    """The target ranks that share one copy of a sharded target (`target.shard_group_size`, null = all of them)."""
    return cfg.target.shard_group_size or len(target_rank_ids(layout, world))


def set_up_rank(cfg: Config, run: RunDir, a: Admitted, ctx, rep: Reporter, fresh_compile_cache: bool) -> RankSetup:
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
                                         share, a.target_fp8_saved_bytes)
        preflight.check_gpu(device, need, ctx.rank, what)
    if ctx.is_main:  # rank 0 writes the checkpoints, from a snapshot in host memory
        preflight.check_host_snapshot(preflight.snapshot_need(cfg.drafter.architecture, a.dcfg), ctx.rank)
    data = open_training_data(cfg, a.tokenizer, run.root / "rejects.jsonl" if ctx.is_main else None)
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
    setup = RankSetup(device, role, drafter_group, drafters, compile_cache, data, batching, per_step, epoch0,
                      steps_per_epoch, total, state, mesh)
    check_indexing(cfg, a, setup, rep)
    return setup


def check_indexing(cfg: Config, a: Admitted, r: RankSetup, rep: Reporter) -> None:
    """How far the plan keeps the compiled graphs from 2^31 elements (indexing.py), over the whole run (the
    target's and the drafter's compiled code alike, so that every rank of a split placement decides the same):
    logged and in status.json, with a warning for a plan that crosses it (64-bit kernels, slower)."""
    d = cfg.drafter
    backend = architecture(d.architecture).resolve_backend(d.attention_backend, r.device, d.block_size)
    widths = indexing.compiled_widths(cfg, a.dcfg, a.target_config, backend, r.device.type == "cuda")
    o = cfg.objective
    largest = indexing.largest_tensor(widths, *r.batching, r.epochs_left(), o.max_anchors, o.max_anchors_per_batch,
                                      backend.blocks_multiple_of, r.data.anchor_positions)
    log.info("%s", largest.describe())
    warning = indexing.over_limit_warning(largest)
    if warning:
        log.warning("%s", warning)
    rep.report(index_largest_elements=largest.elements,
               index_headroom=round(largest.headroom, 2) if largest.elements else None,
               index_64bit_kernels=warning is not None)


def load_target(cfg: Config, plan: Plan, r: RankSetup, rep: Reporter):
    """This rank's target model: whole, or (`target.sharding: fsdp` or `tp`) its shard, read alone from the
    checkpoint; then each rank's peak host memory goes to its heartbeat."""
    if r.target_mesh is None:
        return load_target_model(plan.target_path, plan.target_dtype, r.device, cfg.target.trust_remote_code,
                                 plan.target_fp8_layers)
    load = load_tp_target if cfg.target.sharding == "tp" else load_sharded_target
    model = load(plan.target_path, plan.target_dtype, r.device, r.target_mesh, cfg.target.trust_remote_code)
    rep.beat_fields["host_peak_gib"] = round(peak_host_gib(), 2)
    rep.report(target_sharding=cfg.target.sharding, target_shard_ranks=r.target_mesh[SHARD_DIM].size(),
               host_peak_gib=rep.beat_fields["host_peak_gib"])
    return model


def run_target_rank(cfg: Config, a: Admitted, r: RankSetup, rep: Reporter, stop: StopRequest) -> None:
    """A split placement's target rank: load and (optionally) compile the target, then serve every step."""
    target = TargetCapture.from_model(load_target(cfg, a.plan, r, rep), a.plan.layer_ids, compile=cfg.target.compile)
    if target.compile:  # this rank's only compiled code: warm it before serving any step
        rep.report(phase="warmup")
        target.warm_up(cfg.data.max_length, *batch_kinds(r.epoch0))
    compile_layer.seal()  # from here a compile counts as a recompile after the warm-up, with its guard
    groups = (g for _, _, _, g in micro_batch_groups(r.batching, r.per_step, r.state.epoch, r.state.batch_index))
    rep.report(phase="training", step=r.state.step)
    stop.training()

    def beat(at: int, **extra) -> None:
        rep.beat(at, mem_gib=memory_gib(r.device), role="target",
                 recompiles_after_warmup=compile_layer.recompiles_after_warmup(),
                 last_recompile=compile_layer.last_recompile(), **extra)

    step, note = serve_target(target, a.layout, groups, r.state.step, r.data, a.tokenizer.pad_token_id, cfg,
                              r.device, beat)
    beat(step, phase="done", **({"recompile_limit_near": note} if note else {}))


def build_drafter_rank(cfg: Config, run: RunDir, a: Admitted, r: RankSetup, rep: Reporter, ctx, resume: bool) -> Session:
    """Load the target (colocated) or its embedding and lm_head (split), build the drafter and its optimizer,
    continue from the checkpoint on resume, open validation data: the loop's Session."""
    plan = a.plan
    if a.layout is None:
        target = TargetCapture.from_model(load_target(cfg, plan, r, rep), plan.layer_ids, compile=cfg.target.compile)
    else:  # a split drafter rank: the target's embedding and lm_head, never its decoder
        target = load_target_head(plan.target_path, plan.target_dtype, r.device, cfg.target.trust_remote_code)
    torch.manual_seed(cfg.run.seed)
    arch = architecture(cfg.drafter.architecture)
    drafter = arch.drafter_class(a.dcfg)
    if ctx.is_main:
        write_provenance(run.root, {**a.provenance, **serving_record(drafter)})
    if cfg.drafter.init_from_target and not resume:  # a resume loads the checkpoint's weights over it
        init_drafter_from_target(drafter, plan.target_path)
    if drafter.draft_vocab_size and not resume:  # a resume loads the checkpoint's vocabulary and head
        rep.report(**choose_draft_vocabulary(drafter, r.data, target.lm_head.weight))
    if cfg.drafter.fp8:  # the same parameters, FP8 matmuls; before the compile and the optimizer
        names = use_fp8_training(drafter, cfg.drafter.fp8_grad_weight)
        log.info("drafter.fp8: %d linears train with FP8 matmuls (%s; weight gradients %s); the lm_head, norms and "
                 "attention stay %s", len(names), ", ".join(sorted({n.rpartition(".")[2] for n in names})),
                 cfg.drafter.fp8_grad_weight, plan.compute_dtype)
    drafter = drafter.to(r.device)
    if cfg.drafter.compile:  # compiled by the warm-up
        drafter.compile_layers()
    backend = arch.resolve_backend(cfg.drafter.attention_backend, r.device, cfg.drafter.block_size)
    train_step = TrainStep(drafter, target, backend, cfg, r.total, plan.compute_dtype, r.device, r.drafter_group,
                           ctx.rank, r.drafters)
    log.info("drafter: %d layers, %.1fM parameters; %d steps (%d micro-batches per epoch, %d per step)",
             a.dcfg.num_hidden_layers, sum(p.numel() for p in drafter.parameters()) / 1e6, r.total, len(r.epoch0),
             r.per_step)
    state = r.state
    if a.resume_from is not None:
        ckpt = a.resume_from[0]
        saved = checkpoints.load_into(ckpt, drafter, train_step.optimizer, train_step.scheduler)
        train_step.skipped_steps = saved.get("skipped_steps", 0)
        log.info("resumed from %s: step %d, epoch %d, batch %d", ckpt, state.step, state.epoch, state.batch_index)
        if ctx.is_main:
            _truncate_metrics(run.metrics, state.step)
    inbox = None
    if a.layout is not None:
        inbox = DrafterInbox(a.layout, ctx.rank, cfg.data.token_budget, cfg.data.max_batch_size,
                             len(plan.layer_ids) * a.provenance["hidden_size"], plan.target_dtype, r.device, state.step)
        if state.step < r.total:
            inbox.ask(state.step)  # the target ranks compute the first step while this rank compiles
    rep.open_metrics(cfg.run.report_to, flatten(cfg))  # rank 0: metrics, TensorBoard, run.report_to
    # A sharded colocated target: every rank validates (the same batches and prompts, so the same captures, which
    # each needs its whole shard group); rank 0 alone records it.
    every_rank = r.target_mesh is not None and a.layout is None
    val = open_validation_data(cfg, a.tokenizer, run.root / "rejects-val.jsonl" if ctx.is_main else None) \
        if (ctx.is_main or every_rank) and cfg.run.eval_every else None
    if ctx.is_main and cfg.run.eval_every and val is None:
        log.info("no validation data (prepared val split or data.val_files): validation is off")
    stop_ids = assets.stop_token_ids(plan.target_path, a.tokenizer)
    return Session(cfg, run, ctx.rank, ctx.is_main, r.device, train_step, r.data, a.tokenizer.pad_token_id,
                   r.batching, r.per_step, r.drafters, r.drafter_group, r.total, a.identity,
                   lambda cfg_yaml, record, weights: training_card(cfg_yaml, plan.target_path, plan.layer_ids,
                                                                   plan.mask_token_id, record, weights,
                                                                   serving_record(drafter)),
                   inbox, val, stop_ids)


def choose_draft_vocabulary(drafter, data, target_lm_head: torch.Tensor) -> dict:
    """The reduced draft vocabulary: the `drafter.draft_vocab_size` most frequent label tokens of the training
    data (ties: the lower id), the drafter's head initialised from the target's rows of them. Returns what
    status.json records."""
    counts = data.label_counts(target_lm_head.shape[0])
    ids = draft_vocabulary(counts, drafter.draft_vocab_size)
    drafter.set_draft_vocabulary(torch.from_numpy(ids), target_lm_head)
    share = coverage(counts, ids)
    seen = int((counts > 0).sum())
    log.info("draft vocabulary: %d of the target's %d tokens, covering %.2f%% of the %d training labels (%d distinct "
             "label tokens%s)", len(ids), len(counts), 100 * share, int(counts.sum()), seen,
             "; the rest of the vocabulary are tokens the labels never hold, by id" if seen < len(ids) else "")
    return {"draft_vocab_size": len(ids), "draft_vocab_label_coverage": round(share, 6)}


def warm_up_drafter_rank(s: Session, a: Admitted, r: RankSetup, rep: Reporter) -> dict:
    """The warm-up on the plan's own batches: its first, and the extremes of its sizes over every epoch the
    run reaches (split drafter ranks compile on stand-in captures of the right shape)."""
    rep.report(phase="warmup")
    first = collate([s.data.example(i) for i in r.epoch0[0]], s.pad_id).to(s.device)
    synthetic = None
    if a.layout is not None:  # the compile needs the shapes and dtype of a capture, not its values
        synthetic = torch.randn(*first.input_ids.shape, len(a.plan.layer_ids) * a.provenance["hidden_size"],
                                dtype=a.plan.target_dtype, device=s.device)
    cfg = s.cfg
    edges_of_plan = size_classes.extreme_classes(
        s.lengths, cfg.data.token_budget, cfg.data.max_batch_size, cfg.run.seed, r.epochs_left(),
        cfg.drafter.block_size, cfg.objective.max_anchors, cfg.objective.max_anchors_per_batch,
        s.train_step.backend.blocks_multiple_of)
    log.info("size classes of the plan: %s", size_classes.describe(edges_of_plan))
    extremes = []
    for rows, edges in size_classes.warm_up_batches(edges_of_plan, skip=tuple(r.epoch0[0])):
        extremes.append(collate([s.data.example(i) for i in rows], s.pad_id).to(s.device))
        log.info("warm-up batch: %d rows x %d tokens (%s)", len(rows), extremes[-1].input_ids.shape[1],
                 ", ".join(edges))
    validation = []
    if s.val is not None:  # rank 0: validation's own sizes, in its own mode (validate.py)
        for index, rows, edges in validation_batches_to_warm_up(s.train_step, s.val):
            validation.append((index, collate([s.val.example(i) for i in rows], s.pad_id).to(s.device)))
            log.info("warm-up validation batch %d: %d rows x %d tokens (%s)", index, len(rows),
                     validation[-1][1].input_ids.shape[1], ", ".join(edges))
    return warm_up(s.train_step, first, r.compile_cache, validation, hidden=synthetic, kinds=batch_kinds(r.epoch0),
                   extremes=tuple(extremes))


# The compiled variants one capture can add per compiled function: the layers of one class share one graph per
# shape, and a class whose layers differ in a guarded attribute (sliding-window and full attention) takes two.
CAPTURE_VARIANTS = 2


def serve_target(target: TargetCapture, layout: SplitLayout, groups, start_step: int, data, pad_id: int, cfg: Config,
                 device: torch.device, heartbeat) -> tuple[int, Optional[str]]:
    """A target rank of the split placement: compute the captures the drafter ranks ask for, in
    schedule order, until each has said stop. Before each capture, the recompile-limit check: once a
    compiled function could reach the limit within the captures this rank may still be asked for before the
    drafter ranks can stop (`SplitLayout.captures_until_stop`), every capture carries that news to its drafter
    rank (transport.py, Notes), and the drafter ranks stop the run at a step boundary with a checkpoint.
    Returns the step it stopped at and that note (None: the limit was never near)."""
    outbox = TargetOutbox(layout, cfg.data.token_budget, cfg.data.max_batch_size, device)
    ahead = CAPTURE_VARIANTS * layout.captures_until_stop()
    t0 = time.perf_counter()
    at, note = start_step, None
    for m, rows in layout.produced(torch.distributed.get_rank(), groups, start_step):
        if not outbox.next_ticket(m):
            break
        if note is None:
            note = compile_layer.recompile_headroom_error(ahead)
            if note is not None:
                log.warning("%s; telling the drafter ranks, which stop the run at a step boundary with a checkpoint",
                            note)
        batch = collate([data.example(i) for i in rows], pad_id).to(device)
        outbox.send(m, batch, target(batch.input_ids), note)
        at = m // layout.per_step + 1
        busy = time.perf_counter() - t0 - outbox.wait_s
        heartbeat(at, produced=outbox.sent, wait_s=round(outbox.wait_s, 2), busy_s=round(busy, 2))
    outbox.close()
    log.info("target rank served %d micro-batches; %.1f s waiting for the drafters", outbox.sent, outbox.wait_s)
    return at, note


def _truncate_metrics(path: Path, step: int) -> None:
    """A resumed run re-logs the steps after its checkpoint: drop the killed run's records of them,
    newest file first, across rotated parts (a part left empty is removed)."""
    from ..run.metrics import metrics_parts

    for part in reversed(metrics_parts(path.parent)):
        lines = part.read_text().splitlines()
        keep = []
        for line in lines:
            try:
                if json.loads(line)["step"] <= step:
                    keep.append(line)
            except (json.JSONDecodeError, KeyError):
                continue  # a torn last line from the kill
        if len(keep) == len(lines):
            break  # this part, and every older one, ends at or before the checkpoint
        if not keep and part != path:
            part.unlink()
            continue
        write_text_atomic(part, "".join(line + "\n" for line in keep))  # a kill leaves the old file
        if keep:
            break
