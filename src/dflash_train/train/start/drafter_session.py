"""A drafter rank before its first step: the target (colocated) or its embedding and lm_head (split), the
drafter and its optimizer, the checkpoint's state on resume, the validation data: the loop's `Session`."""

from __future__ import annotations

import logging

import torch

from ... import assets
from ...config.schema import Config
from ...data.label_counts import coverage, draft_vocabulary
from ...data.source import open_validation_data
from ...architectures.init_from_target import init_drafter_from_target
from ...accel.fp8_training import use_fp8_training
from ...target.provenance import serving_record, write_provenance
from ...target.capture import TargetCapture, load_target_head
from ...exports.card import drafter_card
from ...run.directory import RunDir
from ...run.metrics import truncate_metrics
from ...run.reporter import Reporter
from .. import checkpoint as checkpoints
from .directory_admission import flatten
from ..loop.train_loop import Session
from .rank_checks import Admitted
from .rank_setup import RankSetup
from ..loop.step import TrainStep
from .stage_start import load_stage_start
from .target_load import load_target
from ..split.transport import DrafterInbox

log = logging.getLogger(__name__)


def build_drafter_session(cfg: Config, run: RunDir, a: Admitted, r: RankSetup, rep: Reporter, ctx,
                          resume: bool) -> Session:
    """Load the target (colocated) or its embedding and lm_head (split), build the drafter and its optimizer,
    continue from the checkpoint on resume, open validation data: the loop's Session."""
    plan = a.plan
    if a.layout is None:
        target = TargetCapture.from_model(load_target(cfg, plan, r, rep), plan.layer_ids, compile=cfg.target.compile)
    else:  # a split drafter rank: the target's embedding and lm_head, never its decoder
        target = load_target_head(plan.target_path, plan.target_dtype, r.device, cfg.target.trust_remote_code)
    torch.manual_seed(cfg.run.seed)
    drafter = a.arch.drafter_class(a.dcfg)
    if ctx.is_main:
        write_provenance(run.root, {**a.provenance, **serving_record(drafter)})
    if cfg.drafter.init_from_target and not resume:  # a resume loads the checkpoint's weights over it
        init_drafter_from_target(drafter, plan.target_path)
    if cfg.onpolicy.start_from and not resume:  # the stage continues the finished run's drafter
        log.info("onpolicy.start_from: the drafter starts from %s", load_stage_start(drafter, cfg.onpolicy.start_from))
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
    train_step = TrainStep(drafter, target, r.backend, cfg, r.total, plan.compute_dtype, r.device, r.drafter_group,
                           ctx.rank, r.drafters, arch=a.arch)
    log.info("drafter: %d layers, %.1fM parameters; %d steps (%d micro-batches per epoch, %d per step)",
             a.dcfg.num_hidden_layers, sum(p.numel() for p in drafter.parameters()) / 1e6, r.total, len(r.epoch0),
             r.per_step)
    log.info("objective (%s): %s", cfg.drafter.architecture, train_step.objective.describe())
    state = r.state
    if a.resume_from is not None:
        ckpt = a.resume_from[0]
        saved = checkpoints.load_into(ckpt, drafter, train_step.optimizer, train_step.scheduler)
        train_step.skipped_steps = saved.get("skipped_steps", 0)
        log.info("resumed from %s: step %d, epoch %d, batch %d", ckpt, state.step, state.epoch, state.batch_index)
        if ctx.is_main:
            truncate_metrics(run.metrics, state.step)
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
    val_rejects = run.root / "rejects-val.jsonl" if ctx.is_main else None
    val = open_validation_data(cfg, a.tokenizer, a.block_size, val_rejects) \
        if (ctx.is_main or every_rank) and cfg.run.eval_every else None
    if ctx.is_main and cfg.run.eval_every and val is None:
        log.info("no validation data (prepared val split or data.val_files): validation is off")
    stop_ids = assets.stop_token_ids(plan.target_path, a.tokenizer)
    return Session(cfg, run, ctx.rank, ctx.is_main, r.device, train_step, r.data, a.tokenizer.pad_token_id,
                   r.batching, r.per_step, r.drafters, r.drafter_group, r.total, a.identity,
                   lambda cfg_yaml, record, weights: drafter_card(drafter, cfg.run.export_dtype,
                                                                  a.provenance["target"], weights, record=record,
                                                                  cfg_yaml=cfg_yaml),
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
