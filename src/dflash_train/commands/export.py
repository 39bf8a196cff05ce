"""`dflash-train export`: a checkpoint's drafter in the reference format, checked by reloading it."""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Optional

import torch

from ..architectures.attention import sdpa_attention
from ..architectures.io import load_drafter, save_drafter
from ..errors import ConfigError
from ..exports.card import CARD_NAME, drafter_card
from ..files.io import read_json_file
from ..files.layout import STATE
from ..files.outputs import check_export_out, put_in_place
from ..run.metrics import read_metrics
from ..runtime import dtype_named
from ..target.provenance import PROVENANCE_NAME, serving_record

log = logging.getLogger(__name__)


def parity_check(source, exported, dtype: torch.dtype, seed: int = 0) -> None:
    """The exported folder must reproduce the source drafter (cast to the export dtype) exactly: every tensor, by
    name (an architecture's own modules, e.g. a GRU the backbone's forward never runs, included), and the
    backbone's forward."""
    source = source.to(dtype)
    want, got = source.state_dict(), exported.state_dict()
    if set(want) != set(got):
        raise RuntimeError(f"export parity check failed: tensors missing {sorted(set(want) - set(got))[:8]}, "
                           f"unexpected {sorted(set(got) - set(want))[:8]}")
    for name, tensor in want.items():
        if not torch.equal(tensor.cpu(), got[name].cpu()):
            raise RuntimeError(f"export parity check failed: tensor {name} differs")
    if source.draft_vocab_size != exported.draft_vocab_size:
        raise RuntimeError("export parity check failed: the draft vocabulary size differs")
    g = torch.Generator().manual_seed(seed)
    c = source.config
    k = len(source.target_layer_ids)
    hidden = torch.randn(1, 12, k * c.hidden_size, generator=g).to(dtype)
    block = torch.randn(1, source.block_size, c.hidden_size, generator=g).to(dtype)
    pos = torch.cat([torch.arange(12), torch.arange(7, 7 + source.block_size)]).view(1, -1)
    with torch.no_grad():
        a = source(hidden, block, pos, sdpa_attention, None)
        b = exported(hidden, block, pos, sdpa_attention, None)
    if not torch.equal(a, b):
        raise RuntimeError(f"export parity check failed: max difference {(a - b).abs().max().item():.3g}")


def target_head_weight(run_dir: Path, target: Optional[str]) -> torch.Tensor:
    """The target's lm_head weight (float32, CPU): from `target`, or the target the run at `run_dir` trained on."""
    from .. import assets
    from ..config.load import load_config
    from ..target.capture import load_target_head

    trust_remote_code = False
    if target is None:
        if not (run_dir / "config.yaml").is_file():
            raise ConfigError(f"this checkpoint holds a training-time layout of some weights (e.g. factored codebooks), "
                              f"which the export computes from the target's lm_head, and {run_dir / 'config.yaml'} "
                              "(the run's config, which names the target) is not there: pass --target PATH")
        cfg = load_config(run_dir / "config.yaml")
        target, trust_remote_code = cfg.target.path, cfg.target.trust_remote_code
    path = assets.resolve_target(target)
    return load_target_head(path, torch.float32, torch.device("cpu"), trust_remote_code).lm_head.weight


def checkpoint_weights(checkpoint: Path) -> str:
    """Which weights a training checkpoint holds, for the card and the command's output: its step, and how it
    stands against the run's best by validation tau (when the run validated)."""
    from ..train.checkpoint import read_state

    if not (checkpoint / STATE).is_file():
        return ""
    state = read_state(checkpoint)
    step, best_tau = state.get("step"), state.get("best_val_tau")
    if checkpoint.name == "best" and best_tau is not None:
        return f"the best checkpoint by validation tau: step {step} (tau {best_tau:.3f})"
    best = checkpoint.parent / "best"
    if (best / STATE).is_file():
        best_state = read_state(best)
        if best_state.get("step") != step and best_state.get("best_val_tau") is not None:
            return (f"step {step}; the run's best by validation tau is step {best_state['step']} "
                    f"(tau {best_state['best_val_tau']:.3f}): export {best} for it")
    return f"step {step}"


def _run_target(provenance: Optional[dict], cfg_yaml: Optional[str]) -> Optional[str]:
    """The target as the run named it: its dflash_train.json's, else its config's `target.path`."""
    if provenance and provenance.get("target"):
        return str(provenance["target"])
    if cfg_yaml is None:
        return None
    import yaml

    section = (yaml.safe_load(cfg_yaml) or {}).get("target")
    return str(section["path"]) if isinstance(section, dict) and section.get("path") else None


def _logged_step(run_dir: Path, drafter_dir: Path) -> Optional[dict]:
    """The run's last training record (metrics.jsonl) at or before the checkpoint's step, for the card."""
    from ..train.checkpoint import read_state

    if not (drafter_dir.parent / STATE).is_file():
        return None
    step = read_state(drafter_dir.parent).get("step") or 0
    logged = [r for r in read_metrics(run_dir) if "loss" in r and "kind" not in r and r.get("step", 0) <= step]
    return logged[-1] if logged else None


def export_checkpoint(checkpoint: Path, out: Path, dtype: str = "bfloat16", target: Optional[str] = None,
                      overwrite: bool = False) -> Path:
    """`target`: the target's path, for a drafter whose export needs its lm_head (`Drafter.export_needs_target_head`:
    e.g. factored codebooks); by default the one the run's config names. `overwrite`: an earlier export in `out` is moved
    aside (files/outputs.py says what else is refused). The export is built and checked beside `out` and renamed into
    place, so a failed one leaves `out` as it was."""
    out = Path(out)
    check_export_out(out, checkpoint, overwrite)
    src = checkpoint / "drafter" if (checkpoint / "drafter").is_dir() else checkpoint
    drafter = load_drafter(src)
    run_dir = src.parent.parent.parent  # RUN/checkpoints/step-N/drafter
    if drafter.export_needs_target_head:
        drafter = drafter.materialized(target_head_weight(run_dir, target))
    extra = {}
    cfg_yaml = (run_dir / "config.yaml").read_text() if (run_dir / "config.yaml").is_file() else None
    if cfg_yaml is not None:
        extra["training_config.yaml"] = cfg_yaml
    record = None
    if (run_dir / PROVENANCE_NAME).is_file():  # the serving record from the drafter exported (a run may predate it)
        record = {**read_json_file(run_dir / PROVENANCE_NAME, "remove it to export without a provenance record"), **serving_record(drafter)}
        extra[PROVENANCE_NAME] = json.dumps(record, indent=1)
    extra[CARD_NAME] = drafter_card(drafter, dtype, _run_target(record, cfg_yaml), checkpoint_weights(checkpoint),
                                    checkpoint, _logged_step(run_dir, src), cfg_yaml)
    staging = out.with_name(f".{out.name}.export-{os.getpid()}")
    try:
        save_drafter(drafter, staging, dtype=dtype, extra_files=extra)
        parity_check(drafter, load_drafter(staging), dtype_named(dtype))
        moved = put_in_place(staging, out, overwrite)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    if moved is not None:
        log.warning("moved the earlier export that was in %s aside to %s (--overwrite)", out, moved)
    return out
