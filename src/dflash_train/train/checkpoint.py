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
import os
import pickle
import shutil
from pathlib import Path
from typing import Any, Optional

import torch

from ..errors import DamagedFileError, UserError
from ..layout import STATE, list_checkpoints
from ..algorithms.io import load_drafter, save_drafter
from ..runtime import write_json_atomic

log = logging.getLogger(__name__)

class CheckpointError(UserError):
    """A checkpoint that cannot be resumed from; the message names both sides."""


class CheckpointWriteError(CheckpointError):
    """A checkpoint that could not be written (disk full, file too large, no permission, ...). Nothing of it
    is left behind and the checkpoints written before it are untouched; the message names the path, the
    OS error and the newest intact checkpoint."""


class _WriteRecorder:
    """A file wrapper that remembers the OSError of a failed write: torch.save reports a failed write only
    as 'unexpected pos N vs M', which says nothing about a full disk."""

    def __init__(self, f):
        self.f, self.error = f, None

    def write(self, data) -> int:
        try:
            return self.f.write(data)
        except OSError as e:
            self.error = e
            raise

    def flush(self) -> None:
        self.f.flush()


def _save_torch(obj: Any, path: Path) -> None:
    with open(path, "wb") as f:
        rec = _WriteRecorder(f)
        try:
            torch.save(obj, rec)
            f.flush()
        except Exception as e:
            if rec.error is not None and rec.error is not e:
                raise rec.error from e
            raise


def _fsync(path: Path) -> None:
    """Flush a file or a directory entry to the disk: a renamed checkpoint survives a power loss whole."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError:  # some filesystems cannot fsync a directory; the rename is still atomic
        pass
    finally:
        os.close(fd)


def _describe(e: BaseException) -> str:
    if isinstance(e, OSError) and e.strerror:
        return f"[Errno {e.errno}] {e.strerror}" + (f": {e.filename}" if e.filename else "")
    return f"{type(e).__name__}: {e}"


def save_checkpoint(root: Path, step: int, drafter, optimizer, scheduler, state: dict[str, Any], keep_last: int,
                    name: Optional[str] = None) -> Path:
    """`name` (e.g. "best") writes outside the step-N rotation. Built in `.NAME.tmp`, flushed to disk and
    renamed into place; on any failure the temp folder is removed, earlier checkpoints stay as they were
    and CheckpointWriteError says what happened."""
    root = Path(root)
    final = root / (name or f"step-{step:08d}")
    tmp = root / f".{final.name}.tmp"
    old = None
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        save_drafter(drafter, tmp / "drafter", dtype="float32")
        _save_torch({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}, tmp / "optimizer.pt")
        write_json_atomic(tmp / STATE, {"step": step, **state})
        for f in sorted(tmp.rglob("*"), reverse=True):
            _fsync(f)
        _fsync(tmp)
        if final.exists():  # the same step again (or `best`): move the old one aside, never delete it first
            old = root / f".{final.name}.old"
            shutil.rmtree(old, ignore_errors=True)
            final.rename(old)
        tmp.replace(final)
        _fsync(root)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None and old.exists() and not final.exists():
            old.rename(final)
        if not isinstance(e, Exception):  # KeyboardInterrupt, SystemExit: as they are
            raise
        intact = list_checkpoints(root)
        raise CheckpointWriteError(
            f"could not write checkpoint {final}: {_describe(e)}. "
            + (f"The newest complete checkpoint, {intact[-1]}, is intact. " if intact else "No earlier checkpoint exists. ")
            + f"Free disk space or fix permissions on {root}, then continue with --resume"
        ) from e
    for stale in list_checkpoints(root)[:-keep_last]:
        shutil.rmtree(stale, ignore_errors=True)
    for torn in [*root.glob(".*.tmp"), *root.glob(".*.old")]:  # left by a process killed mid-write
        shutil.rmtree(torn, ignore_errors=True)
    return final


def read_state(ckpt: Path) -> dict:
    try:
        return json.loads((ckpt / STATE).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{ckpt}: unreadable {STATE} ({e})") from e


def load_optimizer_state(ckpt: Path) -> dict:
    """optimizer.pt of a checkpoint; an empty, cut or garbled file raises DamagedFileError."""
    path = ckpt / "optimizer.pt"
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except (RuntimeError, EOFError, pickle.UnpicklingError) as e:
        first = str(e).strip().split(". ")[0] or type(e).__name__
        raise DamagedFileError(path, f"not a readable torch file: {first}", "resume from an older checkpoint "
                               f"(move {ckpt} aside)", size=path.stat().st_size) from None


def newest_valid(root: Path) -> Optional[Path]:
    """The newest checkpoint that loads; broken ones are reported and skipped."""
    for ckpt in reversed(list_checkpoints(root)):
        try:
            read_state(ckpt)
            load_drafter(ckpt / "drafter")
            load_optimizer_state(ckpt)
            return ckpt
        except Exception as e:  # any damage means: not this one; say why and try the previous
            log.warning("checkpoint %s is not usable (%s: %s); trying an older one", ckpt, type(e).__name__, e)
    return None


def check_compatible(ckpt: Path, state: dict, expect: dict[str, Any],
                     fields: Optional[dict[str, tuple[str, ...]]] = None) -> None:
    """Refuse a checkpoint of another target or drafter shape, naming both sides. `fields` names the
    entries of list-valued keys (e.g. drafter_shape), so a mismatch says which entry differs."""
    diffs = []
    for key, want in expect.items():
        have = state.get(key)
        if have == want:
            continue
        names = (fields or {}).get(key)
        if names and isinstance(have, list) and len(have) == len(want) == len(names):
            diffs += [f"{key}.{n}: checkpoint {a!r}, this run {b!r}" for n, a, b in zip(names, have, want) if a != b]
        else:
            diffs.append(f"{key}: checkpoint {have!r}, this run {want!r}")
    if diffs:
        raise CheckpointError(f"cannot resume from {ckpt}: it was made for a different setup ({'; '.join(diffs)})")


def load_into(ckpt: Path, drafter, optimizer, scheduler) -> dict:
    """Restore weights, optimizer and scheduler in place; returns the trainer state."""
    state = read_state(ckpt)
    saved = load_drafter(ckpt / "drafter")
    own, theirs = drafter.state_dict(), saved.state_dict()
    diffs = [f"{k}: checkpoint {tuple(theirs[k].shape) if k in theirs else 'absent'}, "
             f"this run {tuple(own[k].shape) if k in own else 'absent'}"
             for k in sorted(set(own) | set(theirs)) if k not in own or k not in theirs or own[k].shape != theirs[k].shape]
    if diffs:
        raise CheckpointError(f"cannot resume from {ckpt}: the drafter's tensors differ ({len(diffs)}: "
                              + "; ".join(diffs[:4]) + ("; ..." if len(diffs) > 4 else "") + ")")
    drafter.load_state_dict({k: v.to(own[k].device) for k, v in saved.state_dict().items()})
    opt = load_optimizer_state(ckpt)
    optimizer.load_state_dict(opt["optimizer"])
    scheduler.load_state_dict(opt["scheduler"])
    return state
