"""`dflash-train train` on one process: load -> train -> checkpoint -> export, with a run directory
that tells at any moment what is happening (status.json, metrics.jsonl, train.log, TensorBoard)."""

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
from typing import Optional

import numpy as np
import torch

from .. import assets
from ..config import Config, dump_config, validate_against_target, validate_compile_device, validate_world
from ..data.batch import Batch, collate
from ..data.dataset import batches_from, padding_fraction, plan_batches
from ..data.source import open_training_data, open_validation_data
from ..model.attention import resolve_backend
from ..model.drafter import DFlashDrafter, default_target_layer_ids
from ..model.drafter_config import make_drafter_config
from ..model.drafter_init import init_drafter_from_target
from ..model.io import save_drafter
from ..model.target import (TargetCapture, default_mask_token_id, load_target_head, load_target_model, load_tokenizer,
                            read_target_config)
from ..errors import UserError, debug_enabled, is_user_error
from ..rundir import (MetricsWriter, Pulse, RunDir, StatusWriter, clear_stop_request, heartbeat_path, stop_requested_since,
                      write_heartbeat)
from ..model import compile as compile_layer
from ..model.provenance import PROVENANCE_NAME, target_provenance, write_provenance
from ..model_card import CARD_NAME, training_card
from ..runtime import resolve_device, resolve_dtype, stop_token_ids, write_text_atomic
from . import checkpoint as checkpoints
from . import preflight
from .admission import holds_run_message, with_step_cap
from .dist import DistContext, StopVote
from .launch import LAUNCH_TIME_ENV
from .step import MicroBatch, StepStats, TrainStep, forward_loss
from .transport import DrafterInbox, SplitLayout, TargetOutbox
from .validate import validate

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
    return Plan(target_path, layer_ids, int(mask), device, target_dtype, compute_dtype), tokenizer


def _record(stats: StepStats, step: int, epoch: float, tokens: int, seconds: float, lr: float) -> dict:
    counted = stats.counted_per_slot.double().cpu()
    correct = stats.correct_per_slot.double().cpu()
    per_pos = [(c / n).item() if n > 0 else None for c, n in zip(correct[1:], counted[1:])]
    kept = max(int(stats.kept_blocks), 1)
    return {
        "step": step,
        "epoch": round(epoch, 4),
        "loss": float(stats.loss.detach()),
        "accuracy": float(correct.sum() / counted.sum().clamp_min(1)),
        "accuracy_per_position": per_pos,
        "tau_estimate": float(stats.accepted_sum) / kept,
        "lr": lr,
        "grad_norm": float(stats.grad_norm) if stats.grad_norm is not None else None,
        "tokens": tokens,
        "tokens_per_s": tokens / max(seconds, 1e-9),
        "recompiles": compile_layer.recompiles(),
        "time": time.time(),
    }


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


def warm_up(train_step: TrainStep, batch, cache_dir: Path, with_validation: bool, hidden: Optional[torch.Tensor] = None,
            kinds: tuple[bool, bool] = (True, True)) -> dict:
    """Compile everything the loop will run, exactly as the loop runs it (grad on, forward + backward,
    production dtype, dynamic shapes, the batch kinds of `batch_kinds`; and the no-grad forward of
    validation), then seal the compile layer. Weights do not change. `cache_dir`: where
    `compile.configure_cache` pointed inductor (reported)."""
    t0 = time.time()
    # target.compile: the target's layers first, batch 1 and >= 2, lengths near the first batch's (no-op when off)
    target_info = train_step.target.warm_up(batch.input_ids.shape[1], *kinds) \
        if isinstance(train_step.target, TargetCapture) else {}
    graphs = compile_layer.graphs_compiled()
    batches = [(batch, hidden), _other_batch_size(batch, hidden)] if all(kinds) else [(batch, hidden)]
    for b, h in batches:
        stats = forward_loss(train_step.drafter, train_step.target, train_step.backend, b, train_step.cfg,
                             torch.Generator().manual_seed(0), train_step.compute_dtype, hidden=h)
        stats.loss.backward()
        train_step.optimizer.zero_grad(set_to_none=True)
        if with_validation:
            with torch.no_grad():
                forward_loss(train_step.drafter, train_step.target, train_step.backend, b, train_step.cfg,
                             torch.Generator().manual_seed(0), train_step.compute_dtype)
    if batch.input_ids.is_cuda:
        torch.cuda.current_stream().synchronize()  # not the NCCL stream: it may hold posted receives
    compile_layer.seal()
    info = {"warmup_s": round(time.time() - t0, 2), "compile_cache_dir": str(cache_dir), **compile_layer.cache_stats(),
            "drafter_compiled_graphs": compile_layer.graphs_compiled() - graphs, **target_info}
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


def _memory_gib(device: torch.device) -> float:
    """Peak accelerator memory of this process, or its peak resident memory on CPU."""
    if device.type == "cuda":
        return round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
    import resource

    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)


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
    target_config = read_target_config(plan.target_path, cfg.target.trust_remote_code)
    d = cfg.drafter
    dcfg = make_drafter_config(
        target_config, num_draft_layers=d.num_draft_layers, block_size=d.block_size,
        target_layer_ids=plan.layer_ids, mask_token_id=plan.mask_token_id, intermediate_size=d.intermediate_size,
        num_attention_heads=d.num_attention_heads, num_key_value_heads=d.num_key_value_heads, head_dim=d.head_dim,
    )
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
    return Admitted(layout, plan, tokenizer, target_config, dcfg, provenance, identity, placement, resume_from)


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


def _micro_batch_groups(batching: tuple, world: int, epoch: int, index: int):
    """Every optimizer step takes `world` consecutive micro-batches (drafter ranks x gradient
    accumulation); an epoch's incomplete last group is dropped on every rank alike. Yields
    (epoch, next index, n, groups)."""
    group, group_epoch = [], epoch
    for ep, idx, n_batches, rows in batches_from(*batching, epoch, index):
        if ep != group_epoch:
            group, group_epoch = [], ep
        group.append(rows)
        if len(group) == world:
            yield ep, idx + 1, n_batches, group
            group = []


def train(cfg: Config, run_root: Path, max_steps: Optional[int] = None, fresh_compile_cache: bool = False,
          resume: bool = False, changes: Optional[dict] = None, launched_at: Optional[float] = None) -> Optional[Path]:
    """One rank of a run (world size 1 = a single process). Rank 0 owns status, metrics, checkpoints.
    In the split placement a target rank serves hidden states (`serve_target`) and returns None.
    Returns the export folder (done), the checkpoints folder (stopped), or None (stopped during start-up,
    or a target rank's end). `changes`: what a resume changed against the run's config (admission.py);
    `launched_at`: when the command that started it was launched (a STOP file older than that is stale)."""
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
    handler = run.attach_log() if ctx.is_main else None
    status = StatusWriter(run) if ctx.is_main else None
    if ctx.is_main:
        take_over(run, cfg, changes, since)
    pulse = Pulse([heartbeat_path(run, ctx.rank)] + ([run.status] if ctx.is_main else [])).start()
    phase, step_box = ["starting"], [0]

    beat_extra: dict = {}  # fields every heartbeat of this rank repeats (its role, once known)

    def report(**fields) -> None:
        if status is not None:
            status.update(**fields)
        if "phase" in fields or "step" in fields:
            write_heartbeat(run, ctx.rank, fields.get("phase", phase[0]), fields.get("step", step_box[0]), **beat_extra)
        if "phase" in fields:
            phase[0] = fields["phase"]

    metrics: Optional[MetricsWriter] = None
    try:
        report(phase="loading")
        layout, plan, tokenizer, dcfg = admitted.layout, admitted.plan, admitted.tokenizer, admitted.dcfg
        target_config, provenance, identity = admitted.target_config, admitted.provenance, admitted.identity
        device = ctx.device(plan.device)
        ctx.init(device)
        drafter_group, drafters, d_rank = None, ctx.world, ctx.rank
        if layout is not None:
            # Every rank takes part in creating the group; only drafter ranks use it.
            drafter_group = torch.distributed.new_group(list(range(layout.drafter_ranks))) \
                if layout.drafter_ranks > 1 else None
            drafters = layout.drafter_ranks
        role = "target" if layout is not None and layout.is_target(ctx.rank) else "drafter"
        compile_cache = compile_layer.configure_cache(cfg.run.compile_cache_dir, fresh=fresh_compile_cache)
        compile_layer.watch_recompiles()
        # A drafter's attention and loss always compile on a GPU: the workers start while the weights load.
        if device.type == "cuda" and (role == "drafter" or cfg.target.compile):
            workers = compile_layer.start_compile_workers(int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
            log.info("compile workers: %d", workers)
        if layout is not None:
            beat_extra["role"] = role
        log.info("rank %d/%d (%s): target %s, layers %s, mask token %d, device %s", ctx.rank, ctx.world, role,
                 plan.target_path, plan.layer_ids, plan.mask_token_id, device)
        bs = cfg.drafter.block_size
        if device.type == "cuda":
            with torch.device("meta"):
                drafter_params = sum(p.numel() for p in DFlashDrafter(dcfg).parameters())
            if role == "drafter" and layout is not None:  # plus the target's embedding and lm_head
                drafter_params += target_config.vocab_size * target_config.hidden_size // 4
            need_role = "colocated" if layout is None else role
            preflight.check_gpu(device, preflight.needed_bytes(preflight.checkpoint_parameters(plan.target_path),
                                                               plan.target_dtype, drafter_params, need_role),
                                ctx.rank, f"the {need_role} rank's weights and optimizer state")
        data = open_training_data(cfg, tokenizer, run.root / "rejects.jsonl" if ctx.is_main else None)
        log.info("data: %s", data.describe())
        lengths = data.lengths
        batching = (lengths, cfg.data.token_budget, cfg.data.max_batch_size, cfg.run.seed)
        per_step = drafters * cfg.optim.grad_accum
        epoch0 = plan_batches(*batching, 0)  # the batch count, the warm-up's batch and its batch kinds
        batches_per_epoch = len(epoch0)
        steps_per_epoch = batches_per_epoch // per_step
        if steps_per_epoch == 0:
            raise ValueError(f"{batches_per_epoch} micro-batches per epoch cannot feed {drafters} drafter rank(s) x "
                             f"{cfg.optim.grad_accum} accumulation; add data")
        total = int(math.ceil(cfg.optim.epochs * steps_per_epoch)) if cfg.optim.epochs > 0 else cfg.optim.max_steps
        if cfg.optim.max_steps:
            total = min(total, cfg.optim.max_steps)
        step, cursor = 0, {"epoch": 0, "batch_index": 0}
        if admitted.resume_from is not None:
            state = admitted.resume_from[1]
            step, cursor = state["step"], {"epoch": state["epoch"], "batch_index": state["batch_index"]}
            if step > total:
                raise UserError(f"--resume: the run is at step {step}, past the {total} steps its config now asks "
                                "for (optim.max_steps / optim.epochs); give a larger optim.max_steps")

        if role == "target":
            model = load_target_model(plan.target_path, plan.target_dtype, device, cfg.target.trust_remote_code)
            target = TargetCapture.from_model(model, plan.layer_ids, compile=cfg.target.compile)
            if target.compile:  # this rank's only compiled code: warm it before serving any step
                report(phase="warmup")
                target.warm_up(cfg.data.max_length, *batch_kinds(epoch0))
            groups = (g for _, _, _, g in _micro_batch_groups(batching, per_step, cursor["epoch"], cursor["batch_index"]))
            report(phase="training", step=step)
            stop.training()
            step = serve_target(target, layout, groups, step, data, tokenizer.pad_token_id, cfg, device,
                         lambda at, **extra: write_heartbeat(run, ctx.rank, "training", at, mem_gib=_memory_gib(device),
                                                             role="target", **extra))
            write_heartbeat(run, ctx.rank, "done", step, mem_gib=_memory_gib(device), **beat_extra)
            return None

        if layout is None:
            model = load_target_model(plan.target_path, plan.target_dtype, device, cfg.target.trust_remote_code)
            target = TargetCapture.from_model(model, plan.layer_ids, compile=cfg.target.compile)
        else:  # a split drafter rank: the target's embedding and lm_head, never its decoder
            target = load_target_head(plan.target_path, plan.target_dtype, device, cfg.target.trust_remote_code)
        if ctx.is_main:
            write_provenance(run.root, provenance)
        torch.manual_seed(cfg.run.seed)
        drafter = DFlashDrafter(dcfg)
        if cfg.drafter.init_from_target and not resume:  # a resume loads the checkpoint's weights over it
            init_drafter_from_target(drafter, plan.target_path)
        drafter = drafter.to(device)
        if cfg.drafter.compile:  # compiled by the warm-up below
            drafter.compile_layers()
        n_params = sum(p.numel() for p in drafter.parameters())
        backend = resolve_backend(cfg.drafter.attention_backend, device, bs)
        train_step = TrainStep(drafter, target, backend, cfg, total, plan.compute_dtype, device, drafter_group, d_rank,
                               drafters)
        log.info("drafter: %d layers, %.1fM parameters; %d steps (%d micro-batches per epoch, %d per step)",
                 dcfg.num_hidden_layers, n_params / 1e6, total, batches_per_epoch, per_step)

        best_val: Optional[float] = None  # best validation tau so far (kept across resumes)
        placement = admitted.placement
        if admitted.resume_from is not None:
            ckpt = admitted.resume_from[0]
            state = checkpoints.load_into(ckpt, drafter, train_step.optimizer, train_step.scheduler)
            train_step.skipped_steps = state.get("skipped_steps", 0)
            best_val = state.get("best_val_tau")
            log.info("resumed from %s: step %d, epoch %d, batch %d", ckpt, step, cursor["epoch"], cursor["batch_index"])
            if ctx.is_main:
                _truncate_metrics(run.metrics, step)

        def save(at_step: int, name: Optional[str] = None) -> Path:
            state = {**cursor, **identity, "skipped_steps": train_step.skipped_steps, "best_val_tau": best_val}
            return checkpoints.save_checkpoint(run.checkpoints, at_step, drafter, train_step.optimizer,
                                               train_step.scheduler, state, cfg.run.keep_last, name)

        inbox = None
        if layout is not None:
            inbox = DrafterInbox(layout, ctx.rank, cfg.data.token_budget, cfg.data.max_batch_size,
                                 len(plan.layer_ids) * provenance["hidden_size"], plan.target_dtype, device, step)
            if step < total:
                inbox.ask(step)  # the target ranks compute the first step while this rank compiles

        metrics = MetricsWriter(run) if ctx.is_main else None
        val = open_validation_data(cfg, tokenizer, run.root / "rejects-val.jsonl") \
            if ctx.is_main and cfg.run.eval_every else None
        if ctx.is_main and cfg.run.eval_every and val is None:
            log.info("no validation data (prepared val split or data.val_files): validation is off")
        stop_ids = stop_token_ids(plan.target_path, tokenizer)
        report(phase="warmup")
        first = collate([data.example(i) for i in epoch0[0]], tokenizer.pad_token_id).to(device)
        synthetic = None
        if layout is not None:  # the compile needs the shapes and dtype of a capture, not its values
            synthetic = torch.randn(*first.input_ids.shape, len(plan.layer_ids) * provenance["hidden_size"],
                                    dtype=plan.target_dtype, device=device)
        warm = warm_up(train_step, first, compile_cache, with_validation=val is not None, hidden=synthetic,
                       kinds=batch_kinds(epoch0))

        def run_validation(at_step: int) -> None:
            nonlocal best_val
            t0 = time.time()
            result = validate(train_step, val, tokenizer.pad_token_id, device, batches=cfg.run.eval_batches,
                              prompts=cfg.run.eval_prompts, max_new_tokens=cfg.run.eval_max_new_tokens,
                              stop_token_ids=stop_ids)
            # the walk covers every response token of the validation batches; real decoding only a few prompts
            score = next((result[k] for k in ("val_tau_walk", "val_tau", "val_tau_estimate") if k in result), None)
            record = {"step": at_step, "kind": "validation", **result, "val_seconds": round(time.time() - t0, 2)}
            if score is not None and (best_val is None or score > best_val):
                best_val = score
                save(at_step, name="best")
                record["best"] = True
            metrics.write(record)
            report(**{k: v for k, v in record.items() if k not in ("step", "kind")}, best_val_tau=best_val)
            log.info("validation at step %d: %s", at_step, ", ".join(f"{k} {v:.4g}" for k, v in result.items()))
        report(phase="training", step=step, total_steps=total, drafter_params=n_params, backend=backend.name,
               world_size=ctx.world, placement=placement, **warm)
        stop.training()
        progress = None
        if cfg.run.progress_bar and ctx.is_main:
            from tqdm import tqdm

            progress = tqdm(total=total, initial=step, desc="train", unit="step", dynamic_ncols=True)
        vote = StopVote(device, drafter_group) if drafters > 1 else None  # the drafter ranks stop together
        t_start, start_step = time.time(), step
        window_tokens, window_start, window_wait = 0, time.time(), 0.0
        last_record: dict = {}
        for epoch, next_index, n_batches, group in _micro_batch_groups(batching, per_step, cursor["epoch"],
                                                                      cursor["batch_index"]):
            if step >= total:
                break
            if ctx.is_main and (next_index <= per_step or step == start_step):
                pad = padding_fraction(lengths, plan_batches(*batching, epoch))
                log.info("epoch %d: %d micro-batches, padding %.1f%% of batch tokens", epoch, n_batches, 100 * pad)
                report(padding_fraction=round(pad, 4))
            if inbox is not None:
                if step + 1 < total:
                    inbox.ask(step + 1)
                micro = inbox.take(step)
            else:
                micro = [MicroBatch(collate([data.example(i) for i in rows], tokenizer.pad_token_id).to(device))
                         for rows in group[ctx.rank::drafters]]
            stats = train_step(micro, step)
            compile_layer.check_step_boundary()
            step += 1
            step_box[0] = step
            cursor = {"epoch": epoch, "batch_index": next_index}
            beat_extra.update(mem_gib=_memory_gib(device), train_s=round(time.time() - t_start, 1),
                              role="colocated" if inbox is None else "drafter",
                              **({"transport_wait_s": round(inbox.wait_s, 2)} if inbox is not None else {}))
            write_heartbeat(run, ctx.rank, "training", step, **beat_extra)
            window_tokens += int(sum(lengths[i] for rows in group for i in rows))
            if step % cfg.run.log_every == 0 or step == total:
                now = time.time()
                lr = train_step.scheduler.get_last_lr()[0]
                last_record = _record(stats, step, epoch + next_index / n_batches, window_tokens, now - window_start, lr)
                last_record["skipped_steps"] = train_step.skipped_steps
                last_record["peak_mem_gib"] = _memory_gib(device)
                if inbox is not None:
                    last_record["transport_wait_s"] = round(inbox.wait_s - window_wait, 3)
                    window_wait = inbox.wait_s
                if metrics is not None:
                    metrics.write(last_record)
                rate = (step - start_step) / max(now - t_start, 1e-9)
                report(step=step, epoch=last_record["epoch"], eta_s=(total - step) / max(rate, 1e-9),
                       tokens_per_s=last_record["tokens_per_s"], loss=last_record["loss"],
                       skipped_steps=last_record["skipped_steps"])
                if progress is not None:
                    progress.set_postfix(loss=f"{last_record['loss']:.3f}", acc=f"{last_record['accuracy']:.3f}",
                                         tok_s=f"{last_record['tokens_per_s']:.0f}")
                log.info("step %d loss %.4f acc %.3f tau~%.2f lr %.2e tok/s %.0f", step, last_record["loss"],
                         last_record["accuracy"], last_record["tau_estimate"], lr, last_record["tokens_per_s"])
                window_tokens, window_start = 0, now
            if progress is not None:
                progress.update(1)
            if stop.requested if vote is None else vote(stop.requested):
                if inbox is not None:
                    inbox.close()
                if ctx.is_main:
                    ckpt = save(step)
                    report(phase="stopped", step=step, checkpoint=str(ckpt))
                    log.info("stopped at step %d; checkpoint %s (continue with --resume)", step, ckpt)
                return run.checkpoints
            if val is not None and (step % cfg.run.eval_every == 0 or step == total):
                run_validation(step)
            if step < total and step % cfg.run.save_every == 0 and ctx.is_main:
                save(step)
        if inbox is not None:
            inbox.close()
        if progress is not None:
            progress.close()
        train_step.raise_if_diverged(step)  # a run of skipped steps at the very end, not seen yet
        if ctx.is_main:
            save(step)
            report(phase="exporting")
            cfg_yaml = run.config.read_text()
            if run.export.is_dir() and any(run.export.iterdir()):  # a resumed run trained past its export: keep it
                kept = run.export.rename(run.root / f"export.before-step-{step:08d}-{time.strftime('%Y%m%d-%H%M%S')}")
                log.info("the previous export moved to %s", kept)
            card = training_card(cfg_yaml, plan.target_path, plan.layer_ids, plan.mask_token_id, last_record)
            save_drafter(drafter, run.export, dtype=cfg.run.export_dtype,
                         extra_files={CARD_NAME: card, "training_config.yaml": cfg_yaml,
                                      PROVENANCE_NAME: (run.root / PROVENANCE_NAME).read_text()})
            report(phase="done", step=step, export_dir=str(run.export), eta_s=0)
            log.info("done: %d steps in %.0f s; drafter exported to %s", step, time.time() - t_start, run.export)
        else:
            report(phase="done", step=step)
        return run.export
    except StoppedDuringStartUp as e:
        if status is not None:
            status.update(phase="stopped", checkpoint=None, stopped_in=phase[0],
                          message=f"{e}: nothing was trained, nothing to checkpoint")
        write_heartbeat(run, ctx.rank, "stopped", step_box[0])
        log.warning("rank %d stopped during %s (%s)", ctx.rank, phase[0], e)
        return None
    except BaseException as e:
        if status is not None:
            status.fail(e)
        else:
            write_heartbeat(run, ctx.rank, "failed", step_box[0], error=f"{type(e).__name__}: {e}")
        # A user's mistake is one line (its traceback is in status.json); anything else keeps its traceback.
        log.error("rank %d failed: %s", ctx.rank, e, exc_info=not is_user_error(e) or debug_enabled())
        raise
    finally:
        stop.__exit__()
        pulse.stop()
        if ctx.is_main:
            clear_stop_request(run)  # consumed: honoured, or too late to matter; never left for a later start
        if metrics is not None:
            metrics.close()
        if handler is not None:
            logging.getLogger("dflash_train").removeHandler(handler)
            handler.close()
        ctx.close()


def serve_target(target: TargetCapture, layout: SplitLayout, groups, start_step: int, data, pad_id: int, cfg: Config,
                 device: torch.device, heartbeat) -> int:
    """A target rank of the split placement: compute the captures the drafter ranks ask for, in
    schedule order, until each has said stop. Returns the step it stopped at."""
    outbox = TargetOutbox(layout, cfg.data.token_budget, cfg.data.max_batch_size, device)
    t0 = time.perf_counter()
    at = start_step
    for m, rows in layout.produced(torch.distributed.get_rank(), groups, start_step):
        if not outbox.next_ticket(m):
            break
        batch = collate([data.example(i) for i in rows], pad_id).to(device)
        outbox.send(m, batch, target(batch.input_ids))
        at = m // layout.per_step + 1
        busy = time.perf_counter() - t0 - outbox.wait_s
        heartbeat(at, produced=outbox.sent, wait_s=round(outbox.wait_s, 2), busy_s=round(busy, 2))
    outbox.close()
    log.info("target rank served %d micro-batches; %.1f s waiting for the drafters", outbox.sent, outbox.wait_s)
    return at


def _truncate_metrics(path: Path, step: int) -> None:
    """A resumed run re-logs the steps after its checkpoint: drop the killed run's records of them,
    newest file first, across rotated parts (a part left empty is removed)."""
    from ..rundir import metrics_parts

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
