"""`dflash-train train` on one process: load -> train -> checkpoint -> export, with a run directory
that tells at any moment what is happening (status.json, metrics.jsonl, train.log, TensorBoard)."""

from __future__ import annotations

import logging
import math
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from .. import assets
from ..config import Config, dump_config, validate_against_target
from ..data.dataset import batches_from, collate, padding_fraction, plan_batches
from ..data.source import open_training_data
from ..model.attention import resolve_backend
from ..model.drafter import DFlashDrafter, default_target_layer_ids
from ..model.drafter_config import make_drafter_config
from ..model.io import save_drafter
from ..model.target import TargetCapture, default_mask_token_id, load_target_model, load_tokenizer, read_target_config
from ..rundir import MetricsWriter, RunDir, StatusWriter, write_json_atomic
from ..model import compile as compile_layer
from .step import StepStats, TrainStep, forward_loss

log = logging.getLogger(__name__)

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("run.device=cuda but no CUDA device is visible; use run.device=cpu or auto")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]


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
    target_dtype = resolve_dtype(cfg.target.dtype, device)
    compute_dtype = resolve_dtype(cfg.run.dtype, device)
    return Plan(target_path, layer_ids, int(mask), device, target_dtype, compute_dtype), tokenizer


def _model_card(cfg_yaml: str, plan: Plan, summary: dict) -> str:
    return (
        "# DFlash drafter\n\n"
        "A block-diffusion speculative-decoding drafter trained with dflash-train.\n\n"
        f"- target: `{plan.target_path}`\n"
        f"- target layer ids: {plan.layer_ids}\n"
        f"- mask token id: {plan.mask_token_id}\n"
        f"- steps: {summary.get('step')}, final loss {summary.get('loss', float('nan')):.4f}, "
        f"accuracy {summary.get('accuracy', float('nan')):.3f}, tau estimate {summary.get('tau_estimate', float('nan')):.3f}\n\n"
        "Load it with the reference DFlash code or a serving engine's DFlash support "
        "(config.json + model.safetensors, no embedding or lm_head: those are the target's).\n\n"
        "## Training config\n\n```yaml\n" + cfg_yaml + "```\n"
    )


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


def save_checkpoint(run: RunDir, step: int, train_step: TrainStep, cursor: dict, keep_last: int) -> Path:
    """checkpoints/step-N/: drafter/ (reference format, float32), optimizer.pt (tensors and plain types
    only: loads with weights_only=True), trainer_state.json. Built in a temp folder, then renamed:
    a checkpoint folder either is complete or does not exist."""
    final = run.checkpoints / f"step-{step:08d}"
    tmp = run.checkpoints / f".step-{step:08d}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_drafter(train_step.drafter, tmp / "drafter", dtype="float32")
    torch.save({"optimizer": train_step.optimizer.state_dict(), "scheduler": train_step.scheduler.state_dict()},
               tmp / "optimizer.pt")
    write_json_atomic(tmp / "trainer_state.json", {"step": step, **cursor})
    shutil.rmtree(final, ignore_errors=True)
    tmp.replace(final)
    ckpts = sorted(p for p in run.checkpoints.glob("step-*") if p.is_dir())
    for old in ckpts[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def warm_up(train_step: TrainStep, batch, fresh_cache: bool, cache_dir: Optional[str]) -> dict:
    """Compile everything the loop will run, exactly as the loop runs it (grad on, forward + backward,
    production dtype, dynamic shapes), then seal the compile layer. Weights do not change."""
    path = compile_layer.configure_cache(cache_dir, fresh=fresh_cache)
    compile_layer.watch_recompiles()
    t0 = time.time()
    stats = forward_loss(train_step.drafter, train_step.target, train_step.backend, batch, train_step.cfg,
                         torch.Generator().manual_seed(0), train_step.compute_dtype)
    stats.loss.backward()
    train_step.optimizer.zero_grad(set_to_none=True)
    if batch.input_ids.is_cuda:
        torch.cuda.synchronize()
    compile_layer.seal()
    info = {"warmup_s": round(time.time() - t0, 2), "compile_cache_dir": str(path), **compile_layer.cache_stats()}
    log.info("warm-up done in %.1f s (compile cache %s: %d hits, %d misses)", info["warmup_s"], path,
             info["fxgraph_cache_hit"], info["fxgraph_cache_miss"])
    return info


def train(cfg: Config, run_root: Path, max_steps: Optional[int] = None, fresh_compile_cache: bool = False) -> Path:
    run = RunDir(run_root).create()
    handler = run.attach_log()
    status = StatusWriter(run)
    dump_config(cfg, run.config)
    metrics: Optional[MetricsWriter] = None
    try:
        status.update(phase="loading")
        plan, tokenizer = plan_run(cfg)
        log.info("target %s, layers %s, mask token %d, device %s", plan.target_path, plan.layer_ids, plan.mask_token_id, plan.device)
        bs = cfg.drafter.block_size
        data = open_training_data(cfg, tokenizer)
        log.info("data: %s", data.describe())
        lengths = data.lengths
        batching = (lengths, cfg.data.token_budget, cfg.data.max_batch_size, cfg.run.seed)
        batches_per_epoch = len(plan_batches(*batching, 0))
        total = int(math.ceil(cfg.optim.epochs * batches_per_epoch)) if cfg.optim.epochs > 0 else cfg.optim.max_steps
        for cap in (cfg.optim.max_steps, max_steps or 0):
            if cap:
                total = min(total, cap)

        model = load_target_model(plan.target_path, plan.target_dtype, plan.device, cfg.target.trust_remote_code)
        target = TargetCapture.from_model(model, plan.layer_ids)
        dcfg = make_drafter_config(
            model.config, num_draft_layers=cfg.drafter.num_draft_layers, block_size=bs,
            target_layer_ids=plan.layer_ids, mask_token_id=plan.mask_token_id,
        )
        torch.manual_seed(cfg.run.seed)
        drafter = DFlashDrafter(dcfg).to(plan.device)
        n_params = sum(p.numel() for p in drafter.parameters())
        backend = resolve_backend(cfg.drafter.attention_backend, plan.device, bs)
        train_step = TrainStep(drafter, target, backend, cfg, total, plan.compute_dtype, plan.device)
        log.info("drafter: %d layers, %.1fM parameters; %d steps (%d micro-batches per epoch)",
                 dcfg.num_hidden_layers, n_params / 1e6, total, batches_per_epoch)

        metrics = MetricsWriter(run)
        status.update(phase="warmup")
        first_rows = plan_batches(*batching, 0)[0]
        warm = warm_up(train_step, collate([data.example(i) for i in first_rows], tokenizer.pad_token_id).to(plan.device),
                       fresh_compile_cache, cfg.run.compile_cache_dir)
        status.update(phase="training", total_steps=total, drafter_params=n_params, backend=backend.name, **warm)
        progress = None
        if cfg.run.progress_bar:
            from tqdm import tqdm

            progress = tqdm(total=total, desc="train", unit="step", dynamic_ncols=True)
        step, epoch, t_start = 0, 0, time.time()
        window_tokens, window_start = 0, time.time()
        last_record: dict = {}
        cursor = {"epoch": 0, "batch_index": 0}  # a resumed run would start batches_from(...) at its checkpoint's cursor
        for epoch, index, n_batches, rows in batches_from(*batching, cursor["epoch"], cursor["batch_index"]):
            if step >= total:
                break
            if index == 0 or step == 0:
                pad = padding_fraction(lengths, plan_batches(*batching, epoch))
                log.info("epoch %d: %d micro-batches, padding %.1f%% of batch tokens", epoch, n_batches, 100 * pad)
                status.update(padding_fraction=round(pad, 4))
            batch = collate([data.example(i) for i in rows], tokenizer.pad_token_id).to(plan.device)
            stats = train_step(batch, step)
            compile_layer.check_step_boundary()
            step += 1
            window_tokens += batch.num_tokens
            if step % cfg.run.log_every == 0 or step == total:
                now = time.time()
                lr = train_step.scheduler.get_last_lr()[0]
                last_record = _record(stats, step, epoch + (index + 1) / n_batches, window_tokens, now - window_start, lr)
                metrics.write(last_record)
                rate = step / (now - t_start)
                status.update(step=step, epoch=last_record["epoch"], eta_s=(total - step) / max(rate, 1e-9),
                              tokens_per_s=last_record["tokens_per_s"], loss=last_record["loss"])
                if progress is not None:
                    progress.set_postfix(loss=f"{last_record['loss']:.3f}", acc=f"{last_record['accuracy']:.3f}",
                                         tok_s=f"{last_record['tokens_per_s']:.0f}")
                log.info("step %d loss %.4f acc %.3f tau~%.2f lr %.2e tok/s %.0f", step, last_record["loss"],
                         last_record["accuracy"], last_record["tau_estimate"], lr, last_record["tokens_per_s"])
                window_tokens, window_start = 0, now
            if progress is not None:
                progress.update(1)
            cursor = {"epoch": epoch, "batch_index": index + 1}  # batches_from() continues exactly here
            if step >= total:
                break
            if step % cfg.run.save_every == 0:
                save_checkpoint(run, step, train_step, cursor, cfg.run.keep_last)
        if progress is not None:
            progress.close()
        save_checkpoint(run, step, train_step, cursor, cfg.run.keep_last)
        status.update(phase="exporting")
        cfg_yaml = run.config.read_text()
        save_drafter(drafter, run.export, dtype=cfg.run.export_dtype,
                     extra_files={"README.md": _model_card(cfg_yaml, plan, last_record), "training_config.yaml": cfg_yaml})
        status.update(phase="done", step=step, export_dir=str(run.export), eta_s=0)
        log.info("done: %d steps in %.0f s; drafter exported to %s", step, time.time() - t_start, run.export)
        return run.export
    except BaseException as e:
        status.fail(e)
        log.error("run failed: %s", e, exc_info=True)
        raise
    finally:
        if metrics is not None:
            metrics.close()
        logging.getLogger("dflash_train").removeHandler(handler)
        handler.close()
