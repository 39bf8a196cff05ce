"""Stopping a rank: SIGTERM / SIGINT, and the run's STOP file written since this start was launched. During
start-up a signal stops the rank at once (`StoppedDuringStartUp`); in the loop it means checkpoint and exit."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

from ...run.directory import RunDir, stop_requested_since
from ..processes.launch import LAUNCH_TIME_ENV

log = logging.getLogger(__name__)


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
