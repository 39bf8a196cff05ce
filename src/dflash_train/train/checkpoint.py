"""Checkpoints: written atomically, the last K kept, found and checked before a resume.

    checkpoints/step-00000120/
      drafter/            the drafter in the reference format (float32 master weights)
      optimizer.pt        optimizer + scheduler state (tensors and plain types: weights_only loading)
      trainer_state.json  step, data cursor (epoch, batch index), world size, what it was trained for
A checkpoint folder exists only complete: it is built as `.step-N.tmp` and renamed; `trainer_state.json`
is written last inside it and is what marks it valid.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any, Optional

import torch

from ..model.io import load_drafter, save_drafter
from ..rundir import write_json_atomic

log = logging.getLogger(__name__)

STATE = "trainer_state.json"


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed from; the message names both sides."""


def save_checkpoint(root: Path, step: int, drafter, optimizer, scheduler, state: dict[str, Any], keep_last: int) -> Path:
    final = root / f"step-{step:08d}"
    tmp = root / f".step-{step:08d}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_drafter(drafter, tmp / "drafter", dtype="float32")
    torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}, tmp / "optimizer.pt")
    write_json_atomic(tmp / STATE, {"step": step, **state})
    if final.exists():
        shutil.rmtree(final)
    tmp.replace(final)
    for old in list_checkpoints(root)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def list_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob("step-*") if p.is_dir() and (p / STATE).is_file())


def read_state(ckpt: Path) -> dict:
    try:
        return json.loads((ckpt / STATE).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{ckpt}: unreadable {STATE} ({e})") from e


def newest_valid(root: Path) -> Optional[Path]:
    """The newest checkpoint that loads; broken ones are reported and skipped."""
    for ckpt in reversed(list_checkpoints(root)):
        try:
            read_state(ckpt)
            load_drafter(ckpt / "drafter")
            torch.load(ckpt / "optimizer.pt", map_location="cpu", weights_only=True)
            return ckpt
        except Exception as e:  # any damage means: not this one; say why and try the previous
            log.warning("checkpoint %s is not usable (%s: %s); trying an older one", ckpt, type(e).__name__, e)
    return None


def check_compatible(ckpt: Path, state: dict, expect: dict[str, Any]) -> None:
    """Refuse a checkpoint of another target or drafter shape, naming both sides."""
    diffs = [f"{k}: checkpoint {state.get(k)!r}, this run {v!r}" for k, v in expect.items() if state.get(k) != v]
    if diffs:
        raise CheckpointError(f"cannot resume from {ckpt}: it was made for a different setup ({'; '.join(diffs)})")


def load_into(ckpt: Path, drafter, optimizer, scheduler) -> dict:
    """Restore weights, optimizer and scheduler in place; returns the trainer state."""
    state = read_state(ckpt)
    saved = load_drafter(ckpt / "drafter")
    own = drafter.state_dict()
    mismatch = [k for k, v in saved.state_dict().items() if k not in own or own[k].shape != v.shape]
    if mismatch or set(own) != set(saved.state_dict()):
        raise CheckpointError(f"cannot resume from {ckpt}: drafter tensors differ in name or shape ({mismatch[:4]})")
    drafter.load_state_dict({k: v.to(own[k].device) for k, v in saved.state_dict().items()})
    opt = torch.load(ckpt / "optimizer.pt", map_location="cpu", weights_only=True)
    optimizer.load_state_dict(opt["optimizer"])
    scheduler.load_state_dict(opt["scheduler"])
    return state
