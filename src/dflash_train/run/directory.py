"""A run directory's names (`RunDir`), the phases a run goes through, what a start writes there, and the
stop request (the STOP file) it honours."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from logging.handlers import RotatingFileHandler
from pathlib import Path
from typing import Optional

from ..files.io import move_aside, write_text_atomic
from ..files.layout import list_checkpoints
from . import procs

PHASES = ("starting", "loading", "warmup", "training", "exporting", "done", "failed", "stopped")
ENDED = ("done", "failed", "stopped")
START_UP_PHASES = ("starting", "loading", "warmup")
# The names a start writes into its run directory (fnmatch patterns): all that a refused start's trace can hold.
START_ENTRIES = ("status.json", "config.yaml", "train.log*", "metrics*.jsonl", "checkpoints", "tensorboard",
                 "heartbeats", "export", "rejects*.jsonl", "resumes.jsonl", "trackers.json", "mlruns", "wandb",
                 "launcher.out", "launcher.pid", "rank-*.out", "STOP", "dflash_train.json")



@dataclass
class RunDir:
    root: Path

    def __post_init__(self) -> None:
        self.root = Path(self.root)

    @property
    def config(self) -> Path:
        return self.root / "config.yaml"

    @property
    def log(self) -> Path:
        return self.root / "train.log"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def status(self) -> Path:
        return self.root / "status.json"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def tensorboard(self) -> Path:
        return self.root / "tensorboard"

    @property
    def export(self) -> Path:
        return self.root / "export"

    @property
    def trackers(self) -> Path:
        """trackers.json: the run id each tracker of run.report_to gave this run (a resume continues it)."""
        return self.root / "trackers.json"

    @property
    def mlruns(self) -> Path:
        return self.root / "mlruns"

    @property
    def stop_file(self) -> Path:
        return self.root / "STOP"

    @property
    def heartbeats(self) -> Path:
        return self.root / "heartbeats"

    def contents(self, own_launch: Optional[float] = None) -> list[str]:
        """What in this directory belongs to a run, described for a message; empty: nothing to lose. `own_launch`:
        the launch time of the start asking, whose own `--detach` record in status.json is not listed."""
        found = []
        if self.status.is_file():
            try:
                st = json.loads(self.status.read_text())
                if own_launch is None or st.get("detached_start") != own_launch or st.get("phase") != "starting":
                    found.append(f"a run {st.get('phase')} at step {st.get('step')} (status.json)")
            except (OSError, json.JSONDecodeError):
                found.append("status.json")
        found += [name for name in ("config.yaml", "metrics.jsonl") if (self.root / name).is_file()]
        ckpts = list_checkpoints(self.checkpoints)
        if ckpts:
            found.append(f"{len(ckpts)} checkpoint(s), newest {ckpts[-1].name}")
        if (self.checkpoints / "best").is_dir():
            found.append("checkpoints/best")
        if self.export.is_dir() and any(self.export.iterdir()):
            found.append("export/ (an exported drafter)")
        return found

    def move_aside(self) -> Path:
        """Rename the directory to a free `NAME.old-YYYYmmdd-HHMMSS[-k]` beside it (never deletes)."""
        return move_aside(self.root)

    def holds_only_a_refused_start(self) -> bool:
        """True when what is here is the trace of a start that failed on a user error before its first checkpoint
        (status.json says failed, with the error marked as the user's, and nothing was trained), or of a `--detach`ed
        start whose process died before the run began (killed while it imported): the same command, fixed, may
        start here again, and the trace goes."""
        try:
            status = json.loads(self.status.read_text())
        except (OSError, json.JSONDecodeError):
            return False
        if not isinstance(status, dict):
            return False
        error = status.get("error")
        refused = (status.get("phase") == "failed" and isinstance(error, dict) and error.get("user_error") is True
                   and status.get("failed_phase") in START_UP_PHASES)
        never_began = (status.get("phase") == "starting" and "detached_start" in status
                       and procs.same_process(status) is False)
        return ((refused or never_began) and not status.get("step")
                and not list_checkpoints(self.checkpoints) and not (self.checkpoints / "best").exists()
                and not (self.export.is_dir() and any(self.export.iterdir())))

    def remove_start_trace(self, kept: Optional[frozenset[str]] = None, keep_root: bool = False) -> list[str]:
        """Delete what a start wrote here, and the directory itself when nothing else is left (unless `keep_root`:
        it was there before). Only for `holds_only_a_refused_start()`. `kept`: the names that were here before the
        start (all else is its); None: unknown, so only START_ENTRIES go. Returns the names removed."""
        import fnmatch
        import shutil

        removed = []
        for entry in sorted(self.root.iterdir()) if self.root.is_dir() else []:
            ours = (entry.name not in kept) if kept is not None else \
                any(fnmatch.fnmatchcase(entry.name, pattern) for pattern in START_ENTRIES)
            if not ours:
                continue
            shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
            removed.append(entry.name)
        if not keep_root and self.root.is_dir() and not any(self.root.iterdir()):
            self.root.rmdir()
        return removed

    def create(self) -> "RunDir":
        for d in (self.root, self.checkpoints, self.tensorboard):
            d.mkdir(parents=True, exist_ok=True)
        return self

    # train.log rotates: train.log.1 .. .3 keep the previous parts, so a run's log stays bounded.
    log_max_bytes = 64 * 2**20
    log_backups = 3

    def attach_log(self) -> logging.Handler:
        handler = RotatingFileHandler(self.log, maxBytes=self.log_max_bytes, backupCount=self.log_backups)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        logging.getLogger("dflash_train").addHandler(handler)
        return handler


# ---------------------------------------------------------------------------- stop requests


def request_stop_file(run: RunDir) -> None:
    write_text_atomic(run.stop_file, f"{time.time()}\n")


def stop_requested_since(run: RunDir, since: float) -> bool:
    """A STOP file written at or after `since` (the time this start began): an older one is stale, left by
    a run that died before consuming it, and never stops a later start."""
    try:
        text = run.stop_file.read_text().strip()
        written = float(text) if text else run.stop_file.stat().st_mtime
    except FileNotFoundError:
        return False
    except (OSError, ValueError):
        written = run.stop_file.stat().st_mtime if run.stop_file.exists() else 0.0
    return written >= since


def clear_stop_request(run: RunDir) -> None:
    run.stop_file.unlink(missing_ok=True)
