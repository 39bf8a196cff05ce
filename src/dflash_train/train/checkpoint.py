"""Checkpoints: written atomically, the last K kept, found and checked before a resume.

    checkpoints/step-00000120/
      drafter/            the drafter in the reference format (float32 master weights)
      optimizer.pt        optimizer + scheduler state (tensors and plain types: weights_only loading)
      trainer_state.json  step, data cursor (epoch, batch index), world size, what it was trained for
A checkpoint folder exists only complete: it is built as `.step-N.tmp` and renamed; `trainer_state.json`
is written last inside it and is what marks it valid.

The training loop does not wait for the disk: `CheckpointWriter.save` copies the drafter's weights, the optimizer
and scheduler state and the trainer record to host memory (`Snapshot.take`: on CUDA into pinned buffers that
`CheckpointWriter.stage` allocates in a thread after the first step and every save reuses, the copies queued on the
compute stream; on the CPU plain clones) and a background thread writes that snapshot (`write_snapshot`) while
training goes on. One write at most is in flight: the next save waits for it first (the buffers are reused). A
failed write is raised in the loop at the next step boundary, save or wait, as the CheckpointWriteError a
synchronous write raises. The files are those `save_checkpoint`, the synchronous path, writes from the same state.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import pickle
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

from ..errors import DamagedFileError, UserError
from ..files.layout import STATE, list_checkpoints, step_folder
from ..architectures.io import drafter_config_text, load_drafter, write_drafter_files
from ..files.io import replace_dir, write_json_atomic

log = logging.getLogger(__name__)

# Tests only: seconds a checkpoint write sleeps before each of its files, so that a test can kill the process or
# fill the disk in the middle of a write deterministically.
WRITE_DELAY_ENV = "DFLASH_TEST_CHECKPOINT_WRITE_DELAY"
# A save that waits longer than this for the previous write says so in train.log.
WAIT_LOG_S = 1.0

class CheckpointError(UserError):
    """A checkpoint that cannot be resumed from; the message names both sides."""


class CheckpointWriteError(CheckpointError):
    """A checkpoint that could not be written (disk full, file too large, no permission, ...). Nothing of it
    is left behind and the checkpoints written before it are untouched; the message names the path, the
    OS error and the newest intact checkpoint."""


class ExportWriteError(UserError):
    """The run's export could not be written (the training itself is complete); the message names the folder, the
    error, and how to write the export from the last checkpoint."""


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


def describe_error(e: BaseException) -> str:
    """An OS error as `[Errno N] text: file`, anything else as `Type: message`."""
    if isinstance(e, OSError) and e.strerror:
        return f"[Errno {e.errno}] {e.strerror}" + (f": {e.filename}" if e.filename else "")
    return f"{type(e).__name__}: {e}"


class HostStaging:
    """Host memory for the snapshots of one writer. On CUDA: pinned buffers, allocated ahead (`allocate`) or at the
    first snapshot and reused by every later one (a buffer is reallocated only if its tensor changes shape or dtype), so that the
    device-to-host copies need neither an allocation nor a synchronisation; the writer is done with them before
    the next snapshot overwrites them (one write in flight). On the CPU: plain clones."""

    def __init__(self, pin: bool = True, buffered: Optional[bool] = None):
        self.buffers: dict[Any, torch.Tensor] = {}
        self.pin = pin
        self.buffered = buffered  # None: buffers for CUDA tensors only (a test sets True to use them on the CPU)

    def copy(self, key: Any, t: torch.Tensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        t = t.detach()
        dtype = dtype or t.dtype
        if not (t.device.type == "cuda" if self.buffered is None else self.buffered):
            out = t.to(dtype=dtype, copy=True)
            return out if out.is_contiguous() else out.contiguous()
        buf = self.buffer(key, t.shape, dtype)
        buf.copy_(t, non_blocking=True)
        return buf

    def buffer(self, key: Any, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """The host buffer of `key`: the one of the last snapshot when its shape and dtype still fit, else new."""
        buf = self.buffers.get(key)
        if buf is None or buf.shape != shape or buf.dtype != dtype:
            buf = self.buffers[key] = torch.empty(shape, dtype=dtype, pin_memory=self.pin)
        return buf

    def allocate(self, wanted: list[tuple[Any, torch.Size, torch.dtype]]) -> None:
        """Make the buffers a snapshot of these tensors will use (`snapshot_tensors`), ahead of it: page-locking
        gigabytes of host memory takes seconds, which the first save would otherwise stall the loop for."""
        for key, shape, dtype in wanted:
            self.buffer(key, shape, dtype)

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers.values())


def _tensors(obj: Any, prefix: str) -> list[tuple[tuple, torch.Tensor]]:
    """Each distinct tensor of `obj` (nested dicts, lists, tuples) with its key path, first occurrence first."""
    seen: set[int] = set()
    out: list[tuple[tuple, torch.Tensor]] = []

    def walk(x: Any, key: tuple) -> None:
        if isinstance(x, torch.Tensor):
            if id(x) not in seen:
                seen.add(id(x))
                out.append(((prefix, *key), x))
        elif isinstance(x, dict):
            for k, v in x.items():
                walk(v, (*key, k))
        elif isinstance(x, (list, tuple)):
            for i, v in enumerate(x):
                walk(v, (*key, i))

    walk(obj, ())
    return out


def _host_copy(obj: Any, staging: HostStaging, prefix: str) -> Any:
    """`obj` (a state dict: nested dicts, lists, tuples, tensors, plain values) with every tensor copied to the host
    through `staging`, the rest deep-copied: the same structure, types and sharing, so that torch.save writes the
    same pickle."""
    memo = {id(x): staging.copy(key, x) for key, x in _tensors(obj, prefix)}
    return copy.deepcopy(obj, memo)


def _weight_dtype(v: torch.Tensor) -> torch.dtype:
    """As save_drafter writes a checkpoint's drafter/: floating tensors in float32, the others as they are."""
    return torch.float32 if v.is_floating_point() else v.dtype


def snapshot_tensors(drafter, optimizer, scheduler) -> list[tuple[Any, torch.Size, torch.dtype]]:
    """(staging key, shape, host dtype) of every tensor `Snapshot.take` copies out, in its order."""
    weights = [(("drafter", k), v.shape, _weight_dtype(v)) for k, v in drafter.state_dict().items()]
    opt = _tensors({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}, "optimizer")
    return weights + [(key, x.shape, x.dtype) for key, x in opt]


@dataclass
class Snapshot:
    """Everything a checkpoint holds, in host memory: what `write_snapshot` writes while training goes on."""

    step: int
    name: Optional[str]  # "best", or None: step-N
    weights: dict[str, torch.Tensor]  # the drafter's state dict as drafter/model.safetensors holds it (float32)
    config_text: str  # drafter/config.json
    optimizer: dict  # optimizer.pt: {"optimizer": ..., "scheduler": ...}
    record: dict  # trainer_state.json, less the step
    ready: Any = None  # CUDA: an event recorded after the copies (the writer waits for it); CPU: None
    started: Any = None  # CUDA: an event recorded before the copies (the copies' device time)
    stall_s: float = 0.0  # what taking it cost the caller (host time)
    copy_s: Optional[float] = field(default=None)  # CUDA: the copies' device time, known once they are done

    @classmethod
    def take(cls, step: int, drafter, optimizer, scheduler, record: dict[str, Any], name: Optional[str] = None,
             staging: Optional[HostStaging] = None) -> "Snapshot":
        t0 = time.perf_counter()
        staging = staging or HostStaging()
        params = list(drafter.parameters())
        cuda = bool(params) and params[0].device.type == "cuda"
        started = ready = None
        if cuda:
            started = torch.cuda.Event(enable_timing=True)
            started.record()
        weights = {k: staging.copy(("drafter", k), v, _weight_dtype(v)) for k, v in drafter.state_dict().items()}
        opt = _host_copy({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}, staging,
                         "optimizer")
        if cuda:
            ready = torch.cuda.Event(enable_timing=True)
            ready.record()
        snap = cls(step, name, weights, drafter_config_text(drafter, "float32"), opt, copy.deepcopy(record),
                   ready, started)
        snap.stall_s = time.perf_counter() - t0
        return snap

    def wait_copied(self) -> None:
        """Block until the device-to-host copies are done (at once on the CPU)."""
        if self.ready is not None:
            self.ready.synchronize()
            self.copy_s = self.started.elapsed_time(self.ready) / 1000

    @property
    def nbytes(self) -> int:
        n = sum(t.numel() * t.element_size() for t in self.weights.values())
        stack = [self.optimizer]
        while stack:
            x = stack.pop()
            if isinstance(x, torch.Tensor):
                n += x.numel() * x.element_size()
            elif isinstance(x, dict):
                stack.extend(x.values())
            elif isinstance(x, (list, tuple)):
                stack.extend(x)
        return n


def _test_delay() -> None:
    delay = float(os.environ.get(WRITE_DELAY_ENV) or 0)
    if delay > 0:
        time.sleep(delay)


def save_checkpoint(root: Path, step: int, drafter, optimizer, scheduler, state: dict[str, Any], keep_last: int,
                    name: Optional[str] = None) -> Path:
    """Write a checkpoint now (the synchronous path: a snapshot written at once). `name` (e.g. "best") writes
    outside the step-N rotation."""
    return write_snapshot(Snapshot.take(step, drafter, optimizer, scheduler, state, name), root, keep_last)


def write_snapshot(snap: Snapshot, root: Path, keep_last: int) -> Path:
    """Built in `.NAME.tmp`, flushed to disk and renamed into place; on any failure the temp folder is removed,
    earlier checkpoints stay as they were and CheckpointWriteError says what happened."""
    root = Path(root)
    final = root / (snap.name or step_folder(snap.step))
    tmp = root / f".{final.name}.tmp"
    try:
        snap.wait_copied()
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        _test_delay()
        write_drafter_files(snap.weights, snap.config_text, tmp / "drafter")
        _test_delay()
        _save_torch(snap.optimizer, tmp / "optimizer.pt")
        _test_delay()
        write_json_atomic(tmp / STATE, {"step": snap.step, **snap.record})
        # the same step again (or `best`): the old one is moved aside, never deleted before the new one is in place
        replace_dir(tmp, final, durable=True)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if not isinstance(e, Exception):  # KeyboardInterrupt, SystemExit: as they are
            raise
        intact = list_checkpoints(root)
        raise CheckpointWriteError(
            f"could not write checkpoint {final}: {describe_error(e)}. "
            + (f"The newest complete checkpoint, {intact[-1]}, is intact. " if intact else "No earlier checkpoint exists. ")
            + f"Free disk space or fix permissions on {root}, then continue with --resume"
        ) from e
    # a process killed between replace_dir's two renames (or, before it, between this writer's own): put it back
    for torn in [*root.glob(".*.old-*"), *root.glob(".*.old")]:
        kept = root / (torn.name[1:].rpartition(".old-")[0] or torn.name[1:-len(".old")])
        if not kept.exists() and (torn / STATE).is_file():
            torn.rename(kept)
        else:
            shutil.rmtree(torn, ignore_errors=True)
    for stale in list_checkpoints(root)[:-keep_last]:
        shutil.rmtree(stale, ignore_errors=True)
    for torn in root.glob(".*.tmp"):  # left by a process killed mid-write
        shutil.rmtree(torn, ignore_errors=True)
    return final


class CheckpointWriter:
    """Rank 0's checkpoints, written in the background: `save` takes a snapshot (the loop's only cost) and a thread
    writes it. At most one write is in flight: a save waits for the previous write first (logged past
    WAIT_LOG_S). A failed write costs only that checkpoint while the one before it is intact: `check` and `save`
    log it and hand it out once (`failed`), training goes on and the next save writes again. A second failure in a
    row raises its CheckpointWriteError in the caller's thread (at `check` or `save`): from then on every step
    trained would be lost with it. `wait` (a stop, the end of the run) raises the error of the write it waits for.
    `timings()` hands the metrics what the saves cost since it was last called."""

    def __init__(self, root: Path, keep_last: int, staging: Optional[HostStaging] = None):
        self.root, self.keep_last = Path(root), keep_last
        self.staging = staging or HostStaging()
        self._staging_thread: Optional[threading.Thread] = None
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None
        self._writing: Optional[Path] = None
        self._lock = threading.Lock()
        self._stall_s = 0.0
        self._written: list[float] = []
        self._copies: list[float] = []
        self._failed_last: Optional[CheckpointWriteError] = None  # the previous write's error, if it failed
        self.failed: Optional[CheckpointWriteError] = None  # a survived failure not yet handed out (`take_failure`)

    def _write(self, snap: Snapshot, final: Path) -> None:
        t0 = time.perf_counter()
        try:
            write_snapshot(snap, self.root, self.keep_last)
        except BaseException as e:  # raised in the loop's thread (check / save / wait)
            self._error = e
            return
        took = time.perf_counter() - t0
        with self._lock:
            self._written.append(took)
            if snap.copy_s is not None:
                self._copies.append(snap.copy_s)
        log.info("checkpoint %s written in %.2f s in the background (%.1f MiB; the loop paid %.3f s for the "
                 "snapshot)", final, took, snap.nbytes / 2**20, snap.stall_s)

    @property
    def in_flight(self) -> Optional[Path]:
        """The checkpoint being written now, or None."""
        return self._writing if self._thread is not None and self._thread.is_alive() else None

    def check(self) -> None:
        """After a write that ended: a first failure is logged and kept in `failed`; a second in a row raises.
        Never waits."""
        if self._thread is not None and not self._thread.is_alive():
            self._join(tolerate=True)

    def take_failure(self) -> Optional[CheckpointWriteError]:
        """A survived write failure, once (for the run's status), or None."""
        e, self.failed = self.failed, None
        return e

    def _join(self, tolerate: bool) -> None:
        self._thread.join()
        self._thread, self._writing = None, None
        e, self._error = self._error, None
        if e is None:
            self._failed_last = None
            return
        if not tolerate or self._failed_last is not None or not isinstance(e, CheckpointWriteError):
            self._failed_last = None
            raise e
        self._failed_last = self.failed = e
        log.error("%s. Training goes on: the next checkpoint is written as usual; if it fails too, the run stops "
                  "there", str(e).split(". Free disk space")[0])

    def wait(self) -> Optional[Path]:
        """Block until the write in flight (if any) is on disk; raise its error. Returns the folder it wrote."""
        done = self._writing
        if self._thread is not None:
            t0 = time.perf_counter()
            self._join(tolerate=False)
            waited = time.perf_counter() - t0
            if waited > WAIT_LOG_S:
                log.info("waited %.1f s for checkpoint %s to be written", waited, done)
        return done

    def stage(self, drafter, optimizer, scheduler) -> None:
        """Allocate the snapshot's host buffers in a thread, once, while training goes on (call it once the
        optimizer state exists: after the first step). Nothing to do where snapshots are plain clones (CPU)."""
        if self._staging_thread is not None:
            return
        params = list(drafter.parameters())
        buffered = self.staging.buffered
        if not (bool(params) and params[0].device.type == "cuda" if buffered is None else buffered):
            return
        wanted = snapshot_tensors(drafter, optimizer, scheduler)
        self._staging_thread = threading.Thread(target=self.staging.allocate, args=(wanted,),
                                                name="checkpoint-staging", daemon=True)
        self._staging_thread.start()

    @property
    def is_staging(self) -> bool:
        """Whether `stage`'s thread is still allocating the host buffers."""
        return self._staging_thread is not None and self._staging_thread.is_alive()

    def save(self, step: int, drafter, optimizer, scheduler, record: dict[str, Any], name: Optional[str] = None,
             wait: bool = False) -> Path:
        """Snapshot now and write in the background (`wait`: and block until it is written). Returns the folder
        the checkpoint has once written."""
        t0 = time.perf_counter()
        if self._staging_thread is not None:
            self._staging_thread.join()  # long done unless the first save comes within seconds of the first step
        if self._thread is not None:
            previous = self._writing
            self._join(tolerate=True)
            waited = time.perf_counter() - t0
            if waited > WAIT_LOG_S:
                log.warning("checkpoint at step %d waited %.1f s for the previous one (%s) to be written: the "
                            "disk is slower than run.save_every steps", step, waited, previous)
        snap = Snapshot.take(step, drafter, optimizer, scheduler, record, name, self.staging)
        final = self.root / (name or step_folder(step))
        with self._lock:
            self._stall_s += time.perf_counter() - t0
        self._writing = final
        self._thread = threading.Thread(target=self._write, args=(snap, final), name=f"checkpoint-{final.name}",
                                        daemon=True)
        self._thread.start()
        if wait:
            self.wait()
        return final

    def timings(self) -> dict[str, float]:
        """`checkpoint_stall_s` (what the loop paid for saves: waiting for a previous write, the snapshot),
        `checkpoint_write_s` (background writes finished) and, on CUDA, `checkpoint_copy_s` (the device time of
        their copies) since the last call; {} when nothing happened."""
        with self._lock:
            out = {}
            if self._stall_s:
                out["checkpoint_stall_s"] = round(self._stall_s, 4)
            if self._written:
                out["checkpoint_write_s"] = round(sum(self._written), 3)
            if self._copies:
                out["checkpoint_copy_s"] = round(sum(self._copies), 4)
            self._stall_s, self._written, self._copies = 0.0, [], []
            return out

    def close(self) -> None:
        """On the way out after another error: let the write in flight finish (a complete checkpoint is worth
        the wait), and log, not raise, its own error."""
        if self._thread is None:
            return
        try:
            self.wait()
        except Exception as e:
            log.error("the checkpoint written when the run failed could not be written either: %s", e)


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
