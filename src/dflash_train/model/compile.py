"""The compile layer: every torch.compile'd function of the process goes through here.

Rules (see compile-safety.md in the design notes):
1. Compiled code runs under one process-wide lock, so no thread can enter Dynamo's per-call
   FX-tracing check while another thread traces (the field's "FX to symbolically trace a
   dynamo-optimized function" crash, and its silent dense fallback).
2. Compilation happens in an explicit warm-up that reproduces training (grad on, forward and
   backward, production dtype, dynamic sequence dimensions); then the layer is sealed: an
   uncompiled flex_attention call raises instead of materialising the dense score matrix.
3. Recompiles are logged with their reason and counted; the global FX tracing flag is checked at
   step boundaries; the inductor cache lives in a persistent, configurable directory.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import threading
import warnings
from pathlib import Path
from typing import Callable

import torch

log = logging.getLogger(__name__)

_LOCK = threading.RLock()
_compiled: dict[str, Callable] = {}
_state = {"sealed": False, "recompiles": 0, "watching": False}

FLEX_EAGER_WARNING = "flex_attention called without torch.compile"


def default_cache_dir() -> Path:
    base = os.environ.get("DFLASH_TRAIN_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "dflash-train")
    return Path(base) / "inductor"


def configure_cache(cache_dir: str | Path | None = None, fresh: bool = False) -> Path:
    """Point inductor at a persistent cache directory (before anything compiles); `fresh` empties it."""
    path = Path(cache_dir) if cache_dir else default_cache_dir()
    if fresh and path.exists():
        # Renamed first: the ranks of a run share the directory and all clear it; one rename wins.
        doomed = path.with_name(f"{path.name}.cleared-{os.getpid()}")
        try:
            path.rename(doomed)
            shutil.rmtree(doomed)
            log.info("compile cache cleared: %s", path)
        except FileNotFoundError:
            log.info("compile cache %s: another rank of this run cleared it", path)
    path.mkdir(parents=True, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path)
    return path


def start_compile_workers(local_ranks: int = 1) -> int:
    """Start inductor's pool of compile worker processes now (after `configure_cache`: they inherit its
    directory) and return its size. Inductor starts it at its first compile and, until the workers are up,
    compiles every kernel in this process, one at a time; started before the model loads, the pool is ready
    when the warm-up compiles. `local_ranks`, the job's processes on this machine, share its cores: inductor
    would give each min(32, cores) workers (256 processes for 8 ranks on 128 cores).
    TORCHINDUCTOR_COMPILE_THREADS overrides; one thread means no pool (in-process compiles)."""
    import torch._inductor.config as inductor_config
    from torch._inductor.async_compile import get_compile_threads, maybe_warm_pool

    inductor_config.compile_threads = compile_workers_per_rank(local_ranks)
    maybe_warm_pool()
    return get_compile_threads()


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def compile_workers_per_rank(local_ranks: int = 1) -> int:
    """TORCHINDUCTOR_COMPILE_THREADS if set, else each of `local_ranks` processes' share of this machine's
    cores, at most 32 (inductor's own cap)."""
    override = os.environ.get("TORCHINDUCTOR_COMPILE_THREADS")
    if override:
        return int(override)
    return max(1, min(32, usable_cores() // max(local_ranks, 1)))


def cache_stats() -> dict[str, int]:
    from torch._dynamo.utils import counters

    inductor = counters["inductor"]
    return {"fxgraph_cache_hit": int(inductor.get("fxgraph_cache_hit", 0)),
            "fxgraph_cache_miss": int(inductor.get("fxgraph_cache_miss", 0))}


class _RecompileCounter(logging.Handler):
    """Counts Dynamo's "Recompiling function ..." records (its other records reach this handler too when
    TORCH_LOGS turns them on)."""

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if not message.startswith("Recompiling function"):
            return
        _state["recompiles"] += 1
        log.warning("torch.compile recompiled (#%d): %s", _state["recompiles"], message)


def watch_recompiles() -> None:
    """Route Dynamo's recompile reasons into our log and count them (shown in metrics)."""
    if _state["watching"]:
        return
    torch._logging.set_logs(recompiles=True)
    logging.getLogger("torch._dynamo").addHandler(_RecompileCounter(level=logging.DEBUG))
    _state["watching"] = True


def recompiles() -> int:
    return int(_state["recompiles"])


def graphs_compiled() -> int:
    """Graphs Dynamo has compiled in this process (first compiles and recompiles, every compiled function):
    a delta of 0 around some calls means they ran existing graphs only."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


@contextlib.contextmanager
def _compile_settings():
    """Two Dynamo settings for every compiled call (context managers per call: on torch >= 2.12 Dynamo's
    config is per thread):
    - no "duck sizing": input sizes that happen to be equal at compile time (a warm-up batch of 8 against
      8 key/value heads, a block part as long as the context) would share one symbol, and a later step where
      they differ would fail the guard and recompile. Each size gets its own symbol.
    - float constants specialised: with dynamic shapes Dynamo first traces Python floats (RMSNorm eps,
      attention scaling, read off the layer passed in) as inputs, fails to turn them into tensors and
      traces the whole function again, a third of a cold compile. They never change between calls."""
    import torch.fx.experimental._config as fx_config

    with fx_config.patch(use_duck_shape=False), torch._dynamo.config.patch(specialize_float=True):
        yield


# Inductor options of every compiled function, its forward and backward graphs alike (torch.compile's
# `options` patch inductor's config for the whole compile, a backward compiled later included):
# - one launch config per pointwise kernel instead of several, each built and then timed at the first
#   call: a cold first step of the 8B benchmark took 5 s less (33.1 -> 27.7 s) and its steps ran as fast
#   (0.706 s; pointwise kernels are memory-bound and few: the matmuls and attention take the time).
INDUCTOR_OPTIONS = {"triton.autotune_pointwise": False}


def compiled(name: str, fn: Callable, **compile_kwargs) -> Callable:
    """`torch.compile(fn, fullgraph=True, ...)` once per process (with `INDUCTOR_OPTIONS` when the backend
    is inductor), called under the process lock with `_compile_settings`."""
    if compile_kwargs.get("backend") in (None, "inductor"):
        compile_kwargs = {**compile_kwargs, "options": {**INDUCTOR_OPTIONS, **(compile_kwargs.get("options") or {})}}
    with _LOCK:
        inner = _compiled.get(name)
        if inner is None:
            inner = torch.compile(fn, fullgraph=True, **compile_kwargs)
            _compiled[name] = inner

    def call(*args, **kwargs):
        with _LOCK, _compile_settings():
            return inner(*args, **kwargs)

    call.__name__ = f"compiled_{name}"
    return call


def seal() -> None:
    """End of warm-up: from now on an eager (dense) flex_attention call is an error."""
    warnings.filterwarnings("error", FLEX_EAGER_WARNING)
    _state["sealed"] = True


def is_sealed() -> bool:
    return bool(_state["sealed"])


def check_step_boundary() -> None:
    """Between steps nothing may be tracing; a set global FX flag means a leaked trace."""
    import torch.fx._symbolic_trace as st

    if getattr(st, "_is_fx_tracing_flag", False):
        raise RuntimeError(
            "the global FX tracing flag is set between training steps: some code traced with torch.fx/make_fx "
            "in another thread; compiled calls would now fail or fall back. Run one process per device and keep "
            "compiled work out of helper threads"
        )


def lock() -> threading.RLock:
    return _LOCK
