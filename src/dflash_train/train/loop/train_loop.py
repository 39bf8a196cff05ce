"""The training loop of a drafter rank: one sitting, from the first planned step to the export.

`trainer.train` admits the start and sets the rank up; `drafter_session.build_drafter_session` builds the target,
the drafter, its data and the resumed state into a `Session`, `warmup.warm_up_drafter_rank` compiles, and
`trainer.train` hands the Session here with the `RunState` to continue from. Each step: take the micro-batches
(collated here, or received from the target ranks in the split placement), one optimizer step, then the
step boundary: compile check, heartbeat, metrics every `log_every`, the recompile-limit and stop votes,
validation, checkpoints. The end: a last checkpoint and the export in the reference format.

Checkpoints (rank 0) are written in the background (`checkpoint.CheckpointWriter`): a save costs the loop a
snapshot to host memory; a failed write stops the run at the next step boundary with its CheckpointWriteError.
A stop, the end of the run and any failure wait for the write in flight.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

from ...config.schema import Config
from ...data.batch import collate
from ...data.dataset import batches_from, padding_fraction, plan_batches
from ...files.layout import STATE, step_folder
from ...accel import compile as compile_layer
from ...architectures.io import load_drafter, save_drafter
from ...exports.card import CARD_NAME, weights_line
from ...target.capture import TargetCapture
from ...target.provenance import PROVENANCE_NAME
from ...run.directory import RunDir
from ...run.reporter import Reporter
from .. import checkpoint as checkpoints
from . import flops
from ..processes.dist import StopVote
from ...architectures import reads_target_final
from ...architectures.stats import DraftWork, StepStats
from .step import MicroBatch, TrainStep
from ..split.transport import DrafterInbox
from .validate import validate

log = logging.getLogger(__name__)


@dataclass
class RunState:
    """Where the run is: the optimizer steps done, the next micro-batch of the data plan, the best validation tau."""

    step: int = 0
    epoch: int = 0
    batch_index: int = 0
    best_val: Optional[float] = None

    def cursor(self) -> dict[str, int]:
        return {"epoch": self.epoch, "batch_index": self.batch_index}


@dataclass
class Session:
    """Everything a drafter rank's loop uses, built by `drafter_session.build_drafter_session` before the first step."""

    cfg: Config
    run: RunDir
    rank: int
    is_main: bool
    device: torch.device
    train_step: TrainStep
    data: Any  # data.source.TrainingData
    pad_id: int
    batching: tuple  # (lengths, token_budget, max_batch_size, seed): the deterministic plan
    per_step: int  # micro-batches per optimizer step over all drafter ranks
    drafters: int  # drafter ranks
    drafter_group: Any  # their process group (None: the default one)
    total: int  # optimizer steps of the run
    identity: dict  # what a checkpoint records it was made for
    model_card: Any  # (config yaml, last log record) -> the export's README.md
    inbox: Optional[DrafterInbox] = None  # split placement: captures arrive from the target ranks
    val: Any = None  # validation data: rank 0 only (every rank with a sharded colocated target)
    stop_ids: list[int] = field(default_factory=list)
    t_start: float = field(default_factory=time.time)
    writer: Optional[checkpoints.CheckpointWriter] = None  # rank 0's background checkpoint writes
    peak_tflops: Optional[float] = None  # what MFU divides by (flops.peak_tflops; None: MFU not reported)

    @property
    def lengths(self):
        return self.batching[0]


def micro_batch_groups(batching: tuple, world: int, epoch: int, index: int):
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


def memory_gib(device: torch.device) -> float:
    """Peak accelerator memory of this process, or its peak resident memory on CPU."""
    if device.type == "cuda":
        return round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
    import resource  # POSIX only: imported where it is used

    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)


def checkpoint_writer(s: Session) -> checkpoints.CheckpointWriter:
    if s.writer is None:
        s.writer = checkpoints.CheckpointWriter(s.run.checkpoints, s.cfg.run.keep_last)
    return s.writer


def save(s: Session, state: RunState, name: Optional[str] = None, wait: bool = False) -> Path:
    """Rank 0: snapshot the state now and write it in the background (`wait`: and wait until it is written).
    Returns the checkpoint's folder."""
    ts = s.train_step
    record = {**state.cursor(), **s.identity, "skipped_steps": ts.skipped_steps, "best_val_tau": state.best_val}
    return checkpoint_writer(s).save(state.step, ts.drafter, ts.optimizer, ts.scheduler, record, name, wait=wait)


def train_loop(s: Session, state: RunState, rep: Reporter, stop) -> Path:
    """Train from `state` to `s.total` steps. Returns the export folder (done) or the checkpoints folder
    (stopped by `stop`: a signal or a STOP file, agreed on by every drafter rank). A failure lets the
    checkpoint write in flight finish first."""
    try:
        return _train_loop(s, state, rep, stop)
    finally:
        if s.writer is not None:
            s.writer.close()


def _train_loop(s: Session, state: RunState, rep: Reporter, stop) -> Path:
    cfg, ts = s.cfg, s.train_step
    s.t_start = time.time()
    s.peak_tflops = flops.peak_tflops(s.device, cfg.run.mfu_peak_tflops)
    progress = None
    if cfg.run.progress_bar and s.is_main:
        from tqdm import tqdm  # the bar's module loads only where a bar is drawn

        progress = tqdm(total=s.total, initial=state.step, desc="train", unit="step", dynamic_ncols=True)
    vote = StopVote(s.device, s.drafter_group) if s.drafters > 1 else None  # the drafter ranks stop together
    # The compiled variants the steps between two recompile checks can add per function at most: per micro-batch
    # two (the loss's chunk function sees a full and a last chunk), per validation batch two; several drafter
    # ranks agree one step late, so they look two periods ahead.
    recompile_vote = StopVote(s.device, s.drafter_group) if s.drafters > 1 else None
    variants_ahead = (2 if recompile_vote else 1) * 2 * (cfg.optim.grad_accum + (cfg.run.eval_batches if s.val else 0))
    window = _Window(state.step)
    accounting = step_accounting(s)
    last_record: dict = {}
    for epoch, next_index, n_batches, group in micro_batch_groups(s.batching, s.per_step, state.epoch,
                                                                 state.batch_index):
        if state.step >= s.total:
            break
        if s.is_main and (next_index <= s.per_step or state.step == window.start_step):
            pad = padding_fraction(s.lengths, plan_batches(*s.batching, epoch))
            log.info("epoch %d: %d micro-batches, padding %.1f%% of batch tokens", epoch, n_batches, 100 * pad)
            rep.report(padding_fraction=round(pad, 4))
        stats = ts(_take_micro_batches(s, state.step, group), state.step)
        compile_layer.check_step_boundary()
        if s.writer is not None:
            s.writer.check()  # a second failed background write in a row stops the run here
            failed = s.writer.take_failure()
            if failed is not None:  # the first: training goes on, the status says what was lost
                rep.report(checkpoint_error=str(failed))
        elif s.is_main:  # the first step made the optimizer state: the snapshot's host buffers, in the background
            checkpoint_writer(s).stage(ts.drafter, ts.optimizer, ts.scheduler)
        state.step, state.epoch, state.batch_index = state.step + 1, epoch, next_index
        rep.beat_fields.update(mem_gib=memory_gib(s.device), train_s=round(time.time() - s.t_start, 1),
                               role="colocated" if s.inbox is None else "drafter",
                               **({"transport_wait_s": round(s.inbox.wait_s, 2)} if s.inbox is not None else {}))
        rep.beat(state.step)
        window.tokens += int(sum(s.lengths[i] for rows in group for i in rows))
        # this rank's micro-batches (the split transport hands a drafter rank the same ones): host sizes only
        window.add(accounting, [s.lengths[i] for rows in group[s.rank::s.drafters] for i in rows], stats.work)
        if state.step % cfg.run.log_every == 0 or state.step == s.total:
            last_record = _log_window(s, state, rep, window, stats, epoch + next_index / n_batches)
            if progress is not None:
                progress.set_postfix(loss=f"{last_record['loss']:.3f}", acc=f"{last_record['accuracy']:.3f}",
                                     tok_s=f"{last_record['tokens_per_s']:.0f}")
        if progress is not None:
            progress.update(1)
        # this rank's compiled functions, or a target rank's (its note arrives with a capture; split/transport.py)
        near = compile_layer.recompile_headroom_error(variants_ahead) or (s.inbox.target_note if s.inbox else None)
        if near is not None if recompile_vote is None else recompile_vote(near is not None):
            _stop_before_the_recompile_limit(s, state, rep, near)
        if stop.requested if vote is None else vote(stop.requested):
            if s.inbox is not None:
                s.inbox.close()
            if s.is_main:
                ckpt = save(s, state, wait=True)
                rep.report(phase="stopped", step=state.step, checkpoint=str(ckpt))
                log.info("stopped at step %d; checkpoint %s (continue with --resume)", state.step, ckpt)
            return s.run.checkpoints
        if s.val is not None and (state.step % cfg.run.eval_every == 0 or state.step == s.total):
            run_validation(s, state, rep)
        if state.step < s.total and state.step % cfg.run.save_every == 0 and s.is_main:
            save(s, state)
    if s.inbox is not None:
        s.inbox.close()
    if progress is not None:
        progress.close()
    ts.raise_if_diverged(state.step)  # a run of skipped steps at the very end, not seen yet
    return finish(s, state, rep, last_record)


def _take_micro_batches(s: Session, step: int, group: list[list[int]]) -> list[MicroBatch]:
    """This rank's share of the step's micro-batches: received (split placement; the next step is asked for
    first, so the target ranks compute it while this one trains) or collated from the data."""
    if s.inbox is not None:
        if step + 1 < s.total:
            s.inbox.ask(step + 1)
        return s.inbox.take(step)
    return [MicroBatch(collate([s.data.example(i) for i in rows], s.pad_id).to(s.device))
            for rows in group[s.rank::s.drafters]]


def step_accounting(s: Session) -> flops.StepAccounting:
    """The FLOP accounting of this rank's steps: the target's capture when this rank runs it (colocated)."""
    ts = s.train_step
    runs_target = s.inbox is None and isinstance(ts.target, TargetCapture)
    return flops.StepAccounting.of(ts.target.model.config if runs_target else None, ts.drafter.target_layer_ids,
                                   reads_target_final(s.cfg, ts.arch), ts.drafter, ts.arch)


@dataclass
class _Window:
    """Tokens, time and this rank's model FLOPs and drafted blocks since the last log line (tokens/s and the
    efficiency fields are measured over it)."""

    start_step: int
    tokens: int = 0
    started: float = field(default_factory=time.time)
    wait: float = 0.0  # the inbox's wait time at the window's start
    t0: float = field(default_factory=time.time)  # the loop's start: the ETA's rate
    steps: int = 0
    target_flops: float = 0.0
    drafter_flops: Optional[float] = 0.0  # None once a step's blocks had no host counts
    blocks: Optional[int] = 0

    def add(self, accounting: flops.StepAccounting, lengths: list[int], work: Optional[DraftWork]) -> None:
        target, drafter = accounting.step(lengths, work)
        self.steps += 1
        self.target_flops += target
        self.drafter_flops = None if drafter is None or self.drafter_flops is None else self.drafter_flops + drafter
        self.blocks = None if work is None or self.blocks is None else self.blocks + work.blocks

    def restart(self, now: float) -> None:
        self.tokens, self.started, self.steps = 0, now, 0
        self.target_flops, self.drafter_flops, self.blocks = 0.0, 0.0, 0


def step_record(stats: StepStats, step: int, epoch: float, tokens: int, seconds: float, lr: float) -> dict:
    """One metrics.jsonl record of the training loop (per log step)."""
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
        "recompiles_after_warmup": compile_layer.recompiles_after_warmup(),
        "time": time.time(),
        **{k: float(v) if k.endswith("_loss") else float(v) / max(float(counted.sum()), 1.0)
           for k, v in stats.extra.items()},
    }


def _log_window(s: Session, state: RunState, rep: Reporter, window: _Window, stats: StepStats, epoch: float) -> dict:
    now = time.time()
    lr = s.train_step.scheduler.get_last_lr()[0]
    record = step_record(stats, state.step, epoch, window.tokens, now - window.started, lr)
    record.update(flops.efficiency_fields(window.target_flops, window.drafter_flops, window.blocks, window.steps,
                                          now - window.started, s.peak_tflops))
    record["skipped_steps"] = s.train_step.skipped_steps
    record["peak_mem_gib"] = memory_gib(s.device)
    if s.inbox is not None:
        record["transport_wait_s"] = round(s.inbox.wait_s - window.wait, 3)
        window.wait = s.inbox.wait_s
    if s.writer is not None:  # the saves since the last record: the loop's stall, the background writes
        record.update(s.writer.timings())
    rep.write_metrics(record)
    rate = (state.step - window.start_step) / max(now - window.t0, 1e-9)
    rep.report(step=state.step, epoch=record["epoch"], eta_s=(s.total - state.step) / max(rate, 1e-9),
               tokens_per_s=record["tokens_per_s"], loss=record["loss"], skipped_steps=record["skipped_steps"],
               recompiles_after_warmup=record["recompiles_after_warmup"], last_recompile=compile_layer.last_recompile(),
               mfu=record["mfu"], drafted_blocks_per_s=record["drafted_blocks_per_s"])
    log.info("step %d loss %.4f acc %.3f tau~%.2f lr %.2e tok/s %.0f%s", state.step, record["loss"], record["accuracy"],
             record["tau_estimate"], lr, record["tokens_per_s"], efficiency_text(record))
    window.restart(now)
    return record


def efficiency_text(record: dict) -> str:
    """The log line's efficiency part: TFLOP a step, MFU (with a peak) and drafted blocks per second."""
    parts = []
    if record.get("step_flops") is not None:
        parts.append(f"{record['step_flops'] / 1e12:.3g} TFLOP/step")
    if record.get("mfu") is not None:
        parts.append(f"MFU {100 * record['mfu']:.1f}% (target {100 * record['target_mfu']:.1f}%, drafter "
                     f"{100 * record['drafter_mfu']:.1f}%)")
    if record.get("drafted_blocks_per_s") is not None:
        parts.append(f"blocks/s {record['drafted_blocks_per_s']:.0f}")
    return "".join(f" {p}" for p in parts)


def _stop_before_the_recompile_limit(s: Session, state: RunState, rep: Reporter, near: Optional[str]) -> None:
    """Every drafter rank comes here at the same step (the vote agreed): the target ranks get their STOP
    tickets, rank 0 checkpoints, and every rank raises with the reason one of them found (gathered once
    rank 0's checkpoint is written, so that no rank ends the run before it)."""
    if s.inbox is not None:
        s.inbox.close()
    ckpt = save(s, state, wait=True) if s.is_main else None
    if ckpt is not None:
        rep.report(checkpoint=str(ckpt))
    if s.drafters > 1:
        reasons: list = [None] * s.drafters
        torch.distributed.all_gather_object(reasons, near, group=s.drafter_group)
        near = near or next((r for r in reasons if r), None)
    where = "train.log and the rank-*.out files" if s.drafters > 1 or s.inbox is not None else "train.log"
    raise compile_layer.RecompileLimitNear(
        f"{near or 'a rank is near its recompile limit'}. "
        f"Stopped at step {state.step}" + (f" with checkpoint {ckpt}" if ckpt else "") + "; --resume continues "
        "from it (a new process starts with no compiled variants). The 'torch.compile recompiled after the "
        f"warm-up' lines of {where} name each failed guard: a size class the warm-up did not compile")


def run_validation(s: Session, state: RunState, rep: Reporter) -> None:
    """Validation at this step (rank 0; every rank with a sharded target, whose captures need them all): rank 0's
    record goes to the metrics and status; a best tau keeps checkpoints/best."""
    t0 = time.time()
    cfg = s.cfg
    result = validate(s.train_step, s.val, s.pad_id, s.device, batches=cfg.run.eval_batches,
                      prompts=cfg.run.eval_prompts, max_new_tokens=cfg.run.eval_max_new_tokens,
                      stop_token_ids=s.stop_ids)
    # the walk covers every response token of the validation batches; real decoding only a few prompts
    score = next((result[k] for k in ("val_tau_walk", "val_tau", "val_tau_estimate") if k in result), None)
    record = {"step": state.step, "kind": "validation", **result, "val_seconds": round(time.time() - t0, 2)}
    if score is not None and (state.best_val is None or score > state.best_val):
        state.best_val = score
        record["best"] = True
        if s.is_main:
            save(s, state, name="best")
    if not s.is_main:
        return
    rep.write_metrics(record)
    rep.report(**{k: v for k, v in record.items() if k not in ("step", "kind")}, best_val_tau=state.best_val)
    log.info("validation at step %d: %s", state.step, ", ".join(f"{k} {v:.4g}" for k, v in result.items()))


def export_weights(s: Session, state: RunState) -> tuple[object, str]:
    """The drafter the run exports, and the card's line saying which: the best checkpoint by validation tau when
    validation ran (checkpoints/best), else the last step's."""
    best = s.run.checkpoints / "best"
    saved = state.best_val is not None and (best / STATE).is_file()
    best_step = checkpoints.read_state(best)["step"] if saved else None
    weights = weights_line(state.step, state.best_val, best_step)
    head = s.train_step.target.lm_head.weight
    if best_step is None or best_step == state.step:
        return s.train_step.drafter.materialized(head), weights
    drafter = load_drafter(best / "drafter")
    if drafter.export_needs_target_head:
        drafter = drafter.materialized(head.detach().float().cpu())
    log.info("exporting the best checkpoint by validation tau (step %d, %.4g), not the last step (%d)", best_step,
             state.best_val, state.step)
    return drafter, weights


def finish(s: Session, state: RunState, rep: Reporter, last_record: dict) -> Path:
    """The last checkpoint and, on rank 0, the export of the best weights (`export_weights`; a previous export,
    from before a resume that trained further, is moved aside, never overwritten). The last checkpoint is written
    in the background while the export is (the weights no longer change; `best`, written before it, is complete
    once its snapshot is taken: one write in flight); the run is done when both are on disk."""
    run = s.run
    if not s.is_main:
        rep.report(phase="done", step=state.step)
        return run.export
    save(s, state)
    rep.report(phase="exporting")
    cfg_yaml = run.config.read_text()
    if run.export.is_dir() and any(run.export.iterdir()):
        kept = run.export.rename(run.root / f"export.before-{step_folder(state.step)}-{time.strftime('%Y%m%d-%H%M%S')}")
        log.info("the previous export moved to %s", kept)
    drafter, weights = export_weights(s, state)
    try:
        save_drafter(drafter, run.export, dtype=s.cfg.run.export_dtype,
                     extra_files={CARD_NAME: s.model_card(cfg_yaml, last_record, weights),
                                  "training_config.yaml": cfg_yaml,
                                  PROVENANCE_NAME: (run.root / PROVENANCE_NAME).read_text()})
    except Exception as e:
        last = checkpoint_writer(s).wait()  # the last checkpoint's own failure, if any, is the one to report
        best = run.checkpoints / "best"
        raise checkpoints.ExportWriteError(
            f"could not write the export {run.export}: {checkpoints.describe_error(e)}. Training is complete and "
            f"its last checkpoint {last} is intact: free disk space or fix permissions, then write the export with "
            f"`dflash-train export {best if state.best_val is not None and (best / STATE).is_file() else last} "
            f"--out {run.export}`") from e
    checkpoint_writer(s).wait()  # the last checkpoint, written meanwhile (a wait over a second is logged)
    rep.report(phase="done", step=state.step, export_dir=str(run.export), export_weights=weights, eta_s=0)
    log.info("done: %d steps in %.0f s; drafter exported to %s (weights: %s)", state.step, time.time() - s.t_start,
             run.export, weights)
    return run.export
