"""The compile layer: every torch.compile'd function of the process goes through here.

Rules (docs/design/compile.md):
1. Compiled code runs under one process-wide lock, so no thread can enter Dynamo's per-call
   FX-tracing check while another thread traces (the "FX to symbolically trace a dynamo-optimized
   function" crash seen in production, and its silent dense fallback).
2. Compilation happens in an explicit warm-up that reproduces training (grad on, forward and
   backward, production dtype, dynamic sequence dimensions); from its start an uncompiled
   flex_attention call raises instead of materialising the dense score matrix, and the seal at its
   end keeps it so for the rest of the process.
3. Recompiles are logged with the guard that failed and counted (those after the seal apart); a
   run stops at a step boundary before a compiled function could reach the recompile limit; the
   global FX tracing flag is checked at step boundaries; the inductor cache lives in a persistent,
   configurable directory.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import logging
import os
import shutil
import threading
from pathlib import Path
from typing import Callable

import torch

log = logging.getLogger(__name__)

_LOCK = threading.RLock()
_compiled: dict[str, Callable] = {}
_codes: dict[str, object] = {}  # name -> the code object Dynamo compiles (its cache entries are the variants)

# Dynamo's recompile limit (variants per function; its default is 8) for every compiled call. The warm-up
# compiles up to ~8 variants of a function (batch kinds x grad and no-grad); the loop stops a run, at a step
# boundary with a checkpoint, before any function could pass this limit (`recompile_headroom_error`).
RECOMPILE_LIMIT = 64
_state = {"sealed": False, "warming": False, "recompiles": 0, "watching": False, "flex_guard": False,
          "eager_flex_allowed": 0, "recompiles_at_seal": 0, "last_recompile": None}
_prefetch: dict = {"thread": None, "done": False}  # prefetch_cache_keys' thread, until the first compiled call
_only: dict[str, tuple[str, ...] | None] = {"names": None}  # restrict_to's filter (precompile children only)


class UncompiledFlexAttention(RuntimeError):
    """flex_attention ran eagerly (the dense reference: the whole score matrix in memory) after the warm-up began."""


def _guard_dense_flex() -> None:
    """Put a check in front of flex_attention's eager kernels, forward and backward (the higher-order ops'
    CompositeExplicitAutograd implementations, which compute the dense score matrix). A compiled call never
    reaches them: inductor generates its own kernels, and tracing runs on fake tensors. Every eager route does
    (`flex_attention` outside torch.compile, a compile with the eager backends, the debug flag), whatever
    torch's once-per-process warning already showed. Idempotent."""
    from torch._C import DispatchKey

    hops = importlib.import_module("torch._higher_order_ops.flex_attention")  # the package exports the op itself

    for hop in (hops.flex_attention, hops.flex_attention_backward):
        kernel = hop.py_kernels.get(DispatchKey.CompositeExplicitAutograd)
        if kernel is None:
            raise RuntimeError(f"torch {torch.__version__}: {hop.name()} has no eager (CompositeExplicitAutograd) "
                               "kernel to guard; the compile layer cannot block a dense flex_attention fallback on "
                               "this version")
        if getattr(kernel, "dflash_guard", False):
            continue

        def guarded(*args, _kernel=kernel, _name=hop.name(), **kwargs):
            if _state["flex_guard"] and not _state["eager_flex_allowed"]:
                raise UncompiledFlexAttention(
                    f"{_name} ran uncompiled after the warm-up began: eager flex attention materialises the whole "
                    "score matrix (276 GB at a 27B production shape). Call it through "
                    "dflash_train.architectures.family.backend.compiled_flex_attention(); for a deliberate reference computation "
                    "wrap it in compile.allow_eager_flex()")
            return _kernel(*args, **kwargs)

        guarded.dflash_guard = True
        hop.py_kernels[DispatchKey.CompositeExplicitAutograd] = guarded
        hop._dispatch_cache.clear()


def begin_warm_up() -> None:
    """Start of a warm-up: from now on an eager flex_attention call is an error (the warm-up must compile what
    training runs; an eager call there would be the dense fallback itself)."""
    _guard_dense_flex()
    _state["flex_guard"] = True
    _state["warming"] = True  # another warm-up in this process (a test's second run): its compiles are expected


@contextlib.contextmanager
def allow_eager_flex():
    """A deliberate eager flex_attention call (a dense reference in a test or a debugging session), also after
    the seal."""
    with _LOCK:
        _state["eager_flex_allowed"] += 1
    try:
        yield
    finally:
        with _LOCK:
            _state["eager_flex_allowed"] -= 1


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
    if cold_compile_levers_on():
        prefetch_cache_keys()
    return get_compile_threads()


def prefetch_cache_keys() -> None:
    """Start hashing the installed torch and Triton files in a background thread: inductor's cache keys
    (`torch_key`, `triton_key`: every .py file of torch; Triton's files and its compiled library),
    which the first compile of every process otherwise computes in the main thread, cold cache or warm, and
    from cold disks on a fresh machine. The thread only reads and hashes files: nothing in it compiles or
    traces (docs/design/compile.md, rule 1), and the first compiled call joins it (`_join_prefetch`) before
    anything compiles. Called by `start_compile_workers`, so it overlaps the model build. Idempotent."""
    from torch._inductor import codecache
    from torch.utils._triton import has_triton_package

    with _LOCK:
        if _prefetch["thread"] is not None or _prefetch["done"]:
            return
        # Imported here, in the main thread, so that the thread imports nothing (two threads importing at once
        # can meet a partly initialised module). A torch without one of the keys skips it.
        keys = [getattr(codecache, "torch_key", None)]
        if has_triton_package():
            importlib.import_module("triton")
            if importlib.util.find_spec("torch._inductor.runtime.triton_compat") is not None:
                importlib.import_module("torch._inductor.runtime.triton_compat")  # what triton_key imports
            keys.append(getattr(codecache, "triton_key", None))
        keys = [key for key in keys if callable(key)]
        if not keys:
            return

        def hash_files() -> None:
            for key in keys:
                key()

        thread = threading.Thread(target=hash_files, name="dflash-prefetch-cache-keys", daemon=True)
        _prefetch["thread"] = thread
        thread.start()


def _join_prefetch() -> None:
    """Wait for `prefetch_cache_keys`' thread (at the first compiled call): from here on only the main thread
    touches the compiler."""
    thread = _prefetch["thread"]
    if thread is not None:
        thread.join()
        _prefetch["thread"], _prefetch["done"] = None, True


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
    """Inductor's FX graph cache and AOTAutograd's cache: hits, misses and (AOTAutograd) bypasses, the graphs
    that cannot be cached at all and so trace their joint graph again on every start."""
    from torch._dynamo.utils import counters

    inductor, aot = counters["inductor"], counters["aot_autograd"]
    return {"fxgraph_cache_hit": int(inductor.get("fxgraph_cache_hit", 0)),
            "fxgraph_cache_miss": int(inductor.get("fxgraph_cache_miss", 0)),
            "aot_cache_hit": int(aot.get("autograd_cache_hit", 0)),
            "aot_cache_miss": int(aot.get("autograd_cache_miss", 0)),
            "aot_cache_bypass": int(aot.get("autograd_cache_bypass", 0))}


# Dynamo's timed phases (`torch._dynamo.utils.compile_times`) summed into the parts of a cold compile.
_PHASES = {
    "compile_s": ("_compile.compile_inner",),
    "dynamo_tracing_s": ("bytecode_tracing",),
    "aot_s": ("aot_collect_metadata", "aot_trace_joint_graph", "min_cut_rematerialization_partition"),
    "fx_passes_s": ("_recursive_pre_grad_passes", "_recursive_joint_graph_passes", "_recursive_post_grad_passes"),
    "lowering_s": ("GraphLowering.run",),
    "scheduling_s": ("Scheduler.__init__",),
    "codegen_s": ("GraphLowering.codegen",),
    "kernel_build_wait_s": ("async_compile.wait",),
    "cache_keys_s": ("inductor_codecache_torch_key", "CacheBase.get_system.triton_key"),
}


def compile_phase_totals() -> dict[str, object]:
    """Seconds this process spent in each part of compiling (all functions, forward and backward; the
    phases nest: `compile_s` holds the others but `cache_keys_s`, which a prefetch thread may spend), the
    rewrites inductor's FX pattern passes made (`pattern_matches`) and, with TORCHINDUCTOR_PATTERN_MATCH_DEBUG=1,
    their count per pattern (`pattern_rewrites`)."""
    from torch._dynamo.utils import compile_times, counters

    names, values = compile_times(repr="csv", aggregate=True)
    seconds = {name: float(value) for name, value in zip(names, values)}
    totals: dict[str, object] = {part: round(sum(seconds.get(k, 0.0) for k in keys), 2)
                                 for part, keys in _PHASES.items()}
    totals["pattern_matches"] = int(counters["inductor"].get("pattern_matcher_count", 0))
    if counters["inductor_pattern_matcher_per_pattern"]:
        totals["pattern_rewrites"] = dict(counters["inductor_pattern_matcher_per_pattern"])
    return totals


class RecompileLimitNear(RuntimeError):
    """A compiled function holds so many variants that the next step could reach Dynamo's recompile limit."""


def _guard_failures(message: str) -> str:
    """The guard failure(s) of a "Recompiling function ..." message, on one line."""
    _, _, rest = message.partition("\n")
    lines = [line.strip() for line in rest.splitlines() if line.strip()]
    lines = [line.removeprefix("- ") for line in lines if not line.startswith("triggered by the following guard")]
    return " | ".join(lines) or f"(torch {torch.__version__} logged no failed guard)"


class _RecompileCounter(logging.Handler):
    """Counts Dynamo's "Recompiling function ..." records (its other records reach this handler too when
    TORCH_LOGS turns them on) and logs each on one line, with the guard that failed."""

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if not message.startswith("Recompiling function"):
            return
        _state["recompiles"] += 1
        where = message.partition("\n")[0][len("Recompiling function "):]
        failed = _guard_failures(message)
        if _state["sealed"] and not _state["warming"]:
            _state["last_recompile"] = f"{where}: {failed}"
            log.warning("torch.compile recompiled after the warm-up (#%d after it, #%d in all): %s; failed guard: %s",
                        recompiles_after_warmup(), _state["recompiles"], where, failed)
        else:
            log.warning("torch.compile recompiled (#%d): %s; failed guard: %s", _state["recompiles"], where, failed)


def watch_recompiles() -> None:
    """Route Dynamo's recompile reasons into our log and count them (shown in metrics)."""
    if _state["watching"]:
        return
    torch._logging.set_logs(recompiles=True)
    logging.getLogger("torch._dynamo").addHandler(_RecompileCounter(level=logging.DEBUG))
    _state["watching"] = True


def recompiles() -> int:
    return int(_state["recompiles"])


def recompiles_after_warmup() -> int:
    """Recompiles since the last seal (0 before it and during a warm-up)."""
    return int(_state["recompiles"] - _state["recompiles_at_seal"]) if _state["sealed"] and not _state["warming"] \
        else 0


def last_recompile() -> str | None:
    """The function and failed guard of the last recompile after the seal."""
    return _state["last_recompile"]


def compiled_variants() -> dict[str, int]:
    """Per compiled function: the variants (Dynamo cache entries) it holds, which count against
    `RECOMPILE_LIMIT`. Names that compile one function (the static and dynamic flex_attention) share them."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    by_code: dict = {}
    for name, code in _codes.items():
        by_code.setdefault(code, []).append(name)
    return {" + ".join(names): len(_debug_get_cache_entry_list(code)) for code, names in by_code.items()}


def recompile_headroom_error(new_variants_ahead: int) -> str | None:
    """None while every compiled function can take `new_variants_ahead` more variants (what the steps until
    the next check can compile at most) without reaching `RECOMPILE_LIMIT`; else what is wrong and why."""
    for name, n in compiled_variants().items():
        if n + new_variants_ahead >= RECOMPILE_LIMIT:
            return (f"torch.compile: {name} holds {n} compiled variants and the steps before the next check could "
                    f"compile up to {new_variants_ahead} more, reaching the recompile limit ({RECOMPILE_LIMIT}), where "
                    f"a compiled call fails in the middle of a step. {recompiles_after_warmup()} recompile(s) after "
                    f"the warm-up, the last: {last_recompile()}")
    return None


def graphs_compiled() -> int:
    """Graphs Dynamo has compiled in this process (first compiles and recompiles, every compiled function):
    a delta of 0 around some calls means they ran existing graphs only."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


@contextlib.contextmanager
def _compile_settings():
    """Dynamo settings for every compiled call (context managers per call: on torch >= 2.12 Dynamo's
    config is per thread):
    - no "duck sizing": input sizes that happen to be equal at compile time (a warm-up batch of 8 against
      8 key/value heads, a block part as long as the context) would share one symbol, and a later step where
      they differ would fail the guard and recompile. Each size gets its own symbol.
    - float constants specialised: with dynamic shapes Dynamo first traces Python floats (RMSNorm eps,
      attention scaling, read off the layer passed in) as inputs, fails to turn them into tensors and
      traces the whole function again, a third of a cold compile. They never change between calls.
    - `RECOMPILE_LIMIT` variants per function, and reaching it is an error, never a silent eager run.
    - AOTAutograd's cache takes graphs that hold a `torch.autograd.Function` (the FP8 drafter's matmul): Dynamo
      traces its forward and backward into the graph, so the cache key covers them (by default the cache
      refuses such graphs, and an FP8 drafter traced its joint graphs again on every start)."""
    import torch._functorch.config as functorch_config
    import torch.fx.experimental._config as fx_config

    aot_cache = ({"autograd_cache_allow_custom_autograd_functions": True}
                 if hasattr(functorch_config, "autograd_cache_allow_custom_autograd_functions") else {})
    with fx_config.patch(use_duck_shape=False), torch._dynamo.config.patch(
            specialize_float=True, recompile_limit=RECOMPILE_LIMIT, fail_on_recompile_limit_hit=True), \
            functorch_config.patch(**aot_cache):
        yield


# Inductor options of every compiled function, its forward and backward graphs alike (torch.compile's
# `options` patch inductor's config for the whole compile, a backward compiled later included):
# - one launch config per pointwise kernel instead of several, each built and then timed at the first
#   call: a cold first step of the 8B benchmark took 5 s less (33.1 -> 27.7 s) and its steps ran as fast
#   (0.706 s; pointwise kernels are memory-bound and few: the matmuls and attention take the time).
# - no size thresholds from the mix-order reduction heuristic (the RMSNorms' backward: the input gradient
#   reduces over rows, the weight gradient over columns, and inductor fuses the two). In its strict mode it
#   fuses only when `rows x columns >= 5 * 2**20`, `rows >= 2 x columns` and `rows >= 4096`, each decided
#   on the compile's sizes and kept as a guard on the dynamic sizes (`512*x.size()[0]*context.size()[1] <
#   5242880`): a batch on the other side recompiled mid-run. Non-strict, it fuses whatever the
#   sizes, with no guard. Where a torch has the heuristic but not that switch, the fusion is off instead.
def _threshold_free_options() -> dict:
    import torch._inductor.config as inductor_config

    triton_config = inductor_config.triton
    if hasattr(triton_config, "mix_order_reduction_non_strict_mode"):
        return {"triton.mix_order_reduction_non_strict_mode": True}
    if hasattr(triton_config, "mix_order_reduction"):
        return {"triton.mix_order_reduction": False}
    return {}


INDUCTOR_OPTIONS = {"triton.autotune_pointwise": False, **_threshold_free_options()}

# The cold-compile levers: `cold_compile_options` and `prefetch_cache_keys`, off unless
# DFLASH_TRAIN_COLD_COMPILE_LEVERS=1 (benchmarks/throughput.py --cold-compile-levers on|off, the A/B). Off by default
# until an A/B on the GPU shows that the step time is unchanged: on the CPU they save ~1 s of a cold compile, and
# some of inductor's pattern passes exist on CUDA only. They cut compile time only: they add no guard (inductor
# options are no part of Dynamo's guards) and no compile.
COLD_COMPILE_LEVERS_ENV = "DFLASH_TRAIN_COLD_COMPILE_LEVERS"


def cold_compile_levers_on() -> bool:
    value = os.environ.get(COLD_COMPILE_LEVERS_ENV, "0")
    if value not in ("0", "1"):
        raise ValueError(f"{COLD_COMPILE_LEVERS_ENV}={value!r}: set 1 (the compile-time levers on, on trial) or 0 "
                         "(the default: inductor's own passes)")
    return value == "1"


def cold_compile_options() -> dict:
    """Inductor options that cost compile time and change no generated kernel of this project's graphs:
    - `pattern_matcher: False`: inductor's FX pattern passes, their one-time registration in each process
      (hundreds of patterns traced or loaded at the first compile: decomposed attention, matmul padding,
      mm + bias, int8/int4 and mkldnn matmuls, split/cat chains, online softmax) and a match attempt per
      pattern over every graph. On our graphs they only fold layout no-ops: view of view, permute of permute,
      cast of cast (CPU, the 8B benchmark's functions at a small width: 101 such rewrites, and the kernels
      inductor generated with and without them identical, the kernel names apart). On a GPU some patterns
      are CUDA-only (matmul padding for sizes not a multiple of 8 or 16, online softmax): the throughput
      benchmark's A/B (`--cold-compile-levers on|off`) reports the rewrites made (`pattern_matches`) and the step
      time beside the compile time."""
    import torch._inductor.config as inductor_config

    return {"pattern_matcher": False} if hasattr(inductor_config, "pattern_matcher") else {}


def inductor_options() -> dict:
    """The options of every inductor compile: `INDUCTOR_OPTIONS`, plus `cold_compile_options` while the
    cold-compile levers are on. Read when a function is first compiled (torch.compile fixes its options)."""
    return {**INDUCTOR_OPTIONS, **(cold_compile_options() if cold_compile_levers_on() else {})}


def restrict_to(parts: tuple[str, ...]) -> None:
    """A precompile child's filter (benchmarks/precompile_fanout.py): from now on only the functions whose name
    contains one of `parts` compile; the others run eagerly. It fills the shared cache with its share of the
    graphs and never trains, so its eager parts cost nothing but time. Flex attention must be among `parts`: an
    eager flex call in a warm-up raises (`UncompiledFlexAttention`), as anywhere else."""
    if not parts:
        raise ValueError("restrict_to: name at least one compiled function")
    with _LOCK:
        if _compiled:
            raise RuntimeError(f"restrict_to: called after {sorted(_compiled)} compiled; call it first")
        _only["names"] = tuple(parts)
    log.warning("precompile child: only the functions named like %s compile in this process", ", ".join(parts))


def restricted_away(name: str) -> bool:
    only = _only["names"]
    return only is not None and not any(part in name for part in only)


def compiled(name: str, fn: Callable, **compile_kwargs) -> Callable:
    """`torch.compile(fn, fullgraph=True, ...)` once per process (with `inductor_options()` when the backend
    is inductor), called under the process lock with `_compile_settings`; `fn` itself in a precompile child
    that `restrict_to` keeps from compiling it."""
    if restricted_away(name):
        return fn
    if compile_kwargs.get("backend") in (None, "inductor"):
        compile_kwargs = {**compile_kwargs, "options": {**inductor_options(), **(compile_kwargs.get("options") or {})}}
    with _LOCK:
        inner = _compiled.get(name)
        if inner is None:
            inner = torch.compile(fn, fullgraph=True, **compile_kwargs)
            _compiled[name] = inner
            code = getattr(fn, "__code__", None)
            if code is not None:
                _codes[name] = code

    def call(*args, **kwargs):
        with _LOCK, _compile_settings():
            if _prefetch["thread"] is not None:
                _join_prefetch()
            return inner(*args, **kwargs)

    call.__name__ = f"compiled_{name}"
    return call


def seal() -> None:
    """End of warm-up: from now on, for the rest of the process, an eager (dense) flex_attention call raises
    `UncompiledFlexAttention`, and recompiles count as recompiles after the warm-up."""
    begin_warm_up()
    _state["sealed"], _state["warming"] = True, False
    _state["recompiles_at_seal"], _state["last_recompile"] = _state["recompiles"], None


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
