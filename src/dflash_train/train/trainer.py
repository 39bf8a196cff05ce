"""One rank's whole run, start to end: admit the start (`start/rank_checks.py`: every check that needs no weights,
before anything is written), set the rank up (`start/rank_setup.py`: process group, data plan, preflight), then on a
split target rank serve hidden states (`split/target_server.py`), else build the target and the drafter and continue
from a checkpoint on resume (`start/drafter_session.py`), warm up (`start/warmup.py`) and train
(`loop/train_loop.py`). Stop requests: `loop/stop.py`. The run directory tells at any moment what is happening
(`run.reporter.Reporter`)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable, Optional

from ..config.schema import Config
from ..errors import debug_enabled, is_user_error
from ..run.directory import RunDir, clear_stop_request
from ..run.reporter import Reporter
from .start.directory_admission import with_step_cap
from .processes.dist import DistContext
from .start.drafter_session import build_drafter_session
from .loop.train_loop import train_loop
from .start.rank_checks import admit, take_over
from .start.rank_setup import set_up_rank
from .loop.stop import StopRequest, StoppedDuringStartUp, launch_time
from .split.target_server import run_target_server
from .start.warmup import warm_up_drafter_rank

log = logging.getLogger(__name__)


def train(cfg: Config, run_root: Path, max_steps: Optional[int] = None, fresh_compile_cache: bool = False,
          resume: bool = False, changes: Optional[dict] = None, launched_at: Optional[float] = None,
          on_admitted: Optional[Callable[[], None]] = None) -> Optional[Path]:
    """One rank of a run (world size 1 = a single process): admit the start, set the rank up, train
    (`loop.train_loop`) or, in the split placement, serve hidden states as a target rank. Rank 0 owns status,
    metrics, checkpoints. Returns the export folder (done), the checkpoints folder (stopped), or None
    (stopped during start-up, or a target rank's end). `changes`: what a resume changed against the run's
    config (start/directory_admission.py); `launched_at`: when the command that started it was launched (a STOP file older
    than that is stale); `on_admitted`: called on rank 0 once the start is admitted and its status is written."""
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
    rep = Reporter(run, ctx.rank, ctx.is_main)
    if ctx.is_main:
        take_over(run, cfg, changes, since)
        if on_admitted is not None:
            on_admitted()
    try:
        rep.report(phase="loading")
        rank = set_up_rank(cfg, run, admitted, ctx, rep, fresh_compile_cache)
        if rank.role == "target":
            run_target_server(cfg, admitted, rank, rep, stop)
            return None
        session = build_drafter_session(cfg, run, admitted, rank, rep, ctx, resume)
        warm = warm_up_drafter_rank(session, admitted, rank, rep)
        rep.report(phase="training", step=rank.state.step, total_steps=rank.total,
                   drafter_params=sum(p.numel() for p in session.train_step.drafter.parameters()),
                   backend=session.train_step.backend.name, world_size=ctx.world, placement=admitted.placement, **warm)
        stop.training()
        return train_loop(session, rank.state, rep, stop)
    except StoppedDuringStartUp as e:
        rep.stopped_during_start_up(e)
        log.warning("rank %d stopped during %s (%s)", ctx.rank, rep.phase, e)
        return None
    except BaseException as e:
        rep.failed(e)
        # A user's mistake is one line (its traceback is in status.json); anything else keeps its traceback.
        log.error("rank %d failed: %s", ctx.rank, e, exc_info=not is_user_error(e) or debug_enabled())
        raise
    finally:
        stop.__exit__()
        if ctx.is_main:
            clear_stop_request(run)  # consumed: honoured, or too late to matter; never left for a later start
        rep.close()
        ctx.close()
