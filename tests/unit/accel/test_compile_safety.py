"""The compile layer (docs/design/compile.md): the production thread race replayed through our layer on CPU,
no silent dense fallback after warm-up, recompiles counted with reasons, the FX flag check."""

import json
import logging
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from dflash_train.accel import compile as compile_layer

RACE = textwrap.dedent("""
    import threading, torch
    from dflash_train.architectures.family.backend import compiled_flex_attention
    from dflash_train.architectures.family.mask import flex_block_mask
    errors = []
    for trial in range(2):
        torch._dynamo.reset()  # cold: every thread's first call must compile
        barrier = threading.Barrier(3)
        def worker(seed):
            try:
                g = torch.Generator().manual_seed(seed)
                q = torch.randn(1, 4, 128, 32, generator=g)
                k = torch.randn(1, 2, 256, 32, generator=g)
                anchors = torch.tensor([[5, 30, 60, 90, 100, 110, 0, 0]])
                keep = torch.tensor([[True] * 6 + [False] * 2])
                bm = flex_block_mask(anchors, keep, 128, 16)
                barrier.wait()  # first calls at the same moment
                out = compiled_flex_attention(dynamic=False)(q, k, k, block_mask=bm, enable_gqa=True)
                assert torch.isfinite(out).all()
            except BaseException as e:
                errors.append(repr(e))
        threads = [threading.Thread(target=worker, args=(i,)) for i in range(3)]
        [t.start() for t in threads]
        [t.join() for t in threads]
    print("errors", len(errors), errors[:1])
    assert not errors
""")


@pytest.mark.long  # ~45 s of threads racing compiles
def test_thread_race_replay_through_our_layer_exits_cleanly():
    """Unserialised, this scenario segfaulted the process in 2 of 2 trials on torch 2.11 (CPU)."""
    proc = subprocess.run([sys.executable, "-c", RACE], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "errors 0" in proc.stdout


SEALED = textwrap.dedent("""
    import json, warnings, torch
    import torch.nn.attention.flex_attention as fa
    from torch.nn.attention.flex_attention import flex_attention
    from dflash_train.accel import compile as compile_layer
    from dflash_train.architectures.family.backend import compiled_flex_attention
    q = torch.randn(1, 2, 128, 16)
    flex_attention(q, q, q)  # before the seal: runs (and torch's once-per-process warning is now spent)
    compile_layer.seal()
    seen = {}
    def attempt(name, fn):
        try:
            fn()
            seen[name] = "ran"
        except compile_layer.UncompiledFlexAttention:
            seen[name] = "raised"
    attempt("eager", lambda: flex_attention(q, q, q))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        attempt("eager, warnings ignored", lambda: flex_attention(q, q, q))
    fa._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG = True
    attempt("eager, debug flag", lambda: flex_attention(q, q, q))
    fa._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG = False
    attempt("eager backend", lambda: torch.compile(flex_attention, backend="eager")(q, q, q))
    attempt("compiled", lambda: compiled_flex_attention(dynamic=False)(q, q, q))
    with compile_layer.allow_eager_flex():
        attempt("eager, allowed", lambda: flex_attention(q, q, q))
    attempt("eager, after the allowance", lambda: flex_attention(q, q, q))
    print(json.dumps(seen))
""")


def test_after_the_seal_every_eager_flex_call_raises_whatever_ran_before():
    """One eager flex_attention call before the seal, others after: every later eager route raises, although
    torch warns only once per process and that warning was spent before the seal (the old seal, a warnings
    filter, let them all run); the compiled call runs, and so does an explicitly allowed reference call. CPU
    flex has no backward: tests/gpu/ checks the eager backward too."""
    proc = subprocess.run([sys.executable, "-c", SEALED], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen == {"eager": "raised", "eager, warnings ignored": "raised", "eager, debug flag": "raised",
                    "eager backend": "raised", "compiled": "ran",
                    "eager, allowed": "ran", "eager, after the allowance": "raised"}


def test_an_eager_flex_call_in_a_warm_up_is_an_error(tiny_target_dir):
    """The trainer's warm-up must compile what training runs: a drafter whose attention runs flex_attention
    eagerly (the dense fallback itself) fails the warm-up at its first call, before any seal."""
    from torch.nn.attention.flex_attention import flex_attention

    from dflash_train.config.load import config_from_dict
    from dflash_train.architectures.family.backend import AttentionBackend
    from dflash_train.architectures.dflash.model import DFlashDrafter
    from dflash_train.architectures.family.config import make_drafter_config
    from dflash_train.target.capture import TargetCapture, load_target_model
    from dflash_train.train.loop.step import Batch, TrainStep
    from dflash_train.train.start.warmup import warm_up

    model = load_target_model(tiny_target_dir, torch.float32, torch.device("cpu"))
    cfg = config_from_dict({"drafter": {"block_size": 16, "num_draft_layers": 1}, "objective": {"max_anchors": 8},
                            "data": {"max_length": 256, "token_budget": 512}})
    drafter = DFlashDrafter(make_drafter_config(model.config, num_draft_layers=1, block_size=16,
                                                target_layer_ids=[1, 3], mask_token_id=5))
    # detached: CPU flex refuses inputs that need a gradient before it gets to the kernel (the GPU test needs not)
    eager_flex = AttentionBackend(
        "flex", lambda q, k, v, mask: flex_attention(q.detach(), k.detach(), v.detach(), enable_gqa=True), 8, 128)
    step = TrainStep(drafter, TargetCapture.from_model(model, [1, 3]), eager_flex, cfg, 10, torch.float32,
                     torch.device("cpu"))
    ids = torch.randint(10, 1000, (2, 200), generator=torch.Generator().manual_seed(0))
    with pytest.raises(compile_layer.UncompiledFlexAttention, match="ran uncompiled after the warm-up began"):
        warm_up(step, Batch(ids, torch.ones_like(ids), torch.tensor([200, 180])), Path("unused"),
                kinds=(False, True))


def test_recompiles_are_counted_and_logged_with_the_reason(caplog):
    compile_layer.watch_recompiles()
    before = compile_layer.recompiles()
    double = compile_layer.compiled("test_double", lambda x: x * 2, dynamic=False)
    with caplog.at_level(logging.WARNING, logger="dflash_train"):
        double(torch.ones(3))
        double(torch.ones(4))
    assert compile_layer.recompiles() == before + 1
    assert "recompiled" in caplog.text and "size mismatch" in caplog.text


def test_a_recompile_after_the_seal_is_logged_on_one_line_with_its_failed_guard_and_counted(caplog):
    """A size threshold in compiled code (here Python's own `if`, as inductor's are in its decisions): a batch on
    the other side after the seal recompiles; the log line names the function and the guard that failed, the
    after-warm-up counter and `last_recompile` (status.json) carry it."""
    compile_layer.watch_recompiles()
    torch._dynamo.reset()
    fn = compile_layer.compiled("test_threshold", lambda x: x * 2 if x.shape[0] < 5 else x * 3, dynamic=True,
                                backend="eager")
    fn(torch.ones(3))
    fn(torch.ones(4))  # the same variant
    compile_layer.seal()
    assert compile_layer.recompiles_after_warmup() == 0
    with caplog.at_level(logging.WARNING, logger="dflash_train"):
        assert torch.equal(fn(torch.ones(7)), torch.full((7,), 3.0))
    lines = [r.getMessage() for r in caplog.records if "recompiled after the warm-up" in r.getMessage()]
    assert len(lines) == 1 and "\n" not in lines[0], lines
    assert "(#1 after it" in lines[0] and "<lambda>" in lines[0]
    assert "failed guard: 0/0: 2 <= x.size()[0] <= 4" in lines[0], lines[0]
    assert compile_layer.recompiles_after_warmup() == 1
    assert "2 <= x.size()[0] <= 4" in compile_layer.last_recompile()


def test_the_headroom_check_fires_before_dynamo_would_refuse_a_compile(monkeypatch):
    """`recompile_headroom_error(k)` speaks up once a function's variants plus the k a next step could add reach the
    compile layer's recompile limit; past the limit Dynamo refuses to compile (an error mid-step, never a silent
    eager run): the check is what keeps a run from getting there."""
    monkeypatch.setattr(compile_layer, "RECOMPILE_LIMIT", 5)
    torch._dynamo.reset()
    fn = compile_layer.compiled("test_headroom", lambda x: x + 1, dynamic=False, backend="eager")
    answers = []
    for n in range(1, 6):
        fn(torch.ones(n))  # static shapes: every size is a variant
        assert compile_layer.compiled_variants()["test_headroom"] == n
        answers.append(compile_layer.recompile_headroom_error(2))
    assert answers[:2] == [None, None] and all(answers[2:]), answers
    assert "test_headroom holds 3 compiled variants" in answers[2] and "recompile limit (5)" in answers[2]
    with pytest.raises(Exception, match="recompile_limit|FailOnRecompileLimitHit|fail_on_recompile_limit_hit"):
        fn(torch.ones(6))


def test_fx_tracing_flag_is_checked_at_step_boundaries():
    import torch.fx._symbolic_trace as st

    compile_layer.check_step_boundary()
    old = st._is_fx_tracing_flag
    st._is_fx_tracing_flag = True
    try:
        with pytest.raises(RuntimeError, match="FX tracing flag"):
            compile_layer.check_step_boundary()
    finally:
        st._is_fx_tracing_flag = old


def test_cache_dir_is_configurable_and_can_be_cleared(tmp_path, monkeypatch):
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    path = compile_layer.configure_cache(tmp_path / "cache")
    (path / "stale").write_text("x")
    import os

    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(path)
    compile_layer.configure_cache(tmp_path / "cache", fresh=True)
    assert path.is_dir() and not (path / "stale").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache"]  # the renamed old directory is gone


def test_clearing_a_cache_another_rank_cleared_is_no_error(tmp_path, monkeypatch):
    """The ranks of a run share the cache directory and each clears it for --fresh-compile-cache: a rank that
    finds it gone (renamed by another) goes on."""
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    path = compile_layer.configure_cache(tmp_path / "cache")
    (path / "stale").write_text("x")
    real_rename = Path.rename

    def another_rank_first(self, target):
        real_rename(self, tmp_path / "taken-by-another-rank")  # the other rank's rename wins the race
        return real_rename(self, target)

    monkeypatch.setattr(Path, "rename", another_rank_first)
    assert compile_layer.configure_cache(tmp_path / "cache", fresh=True) == path
    assert path.is_dir() and list(path.iterdir()) == []


def test_doctor_gives_a_verdict(capsys, tmp_path, monkeypatch):
    """The verdict, plus what a cold start depends on: whether the compile cache holds compiled code, and how
    many compile workers each rank of this machine starts."""
    import os

    from dflash_train.cli import main
    from dflash_train.commands.doctor import cache_check

    monkeypatch.setenv("DFLASH_TRAIN_CACHE", str(tmp_path))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    monkeypatch.delenv("TORCHINDUCTOR_COMPILE_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)), raising=False)
    rc = main(["doctor"])
    out = capsys.readouterr().out
    assert rc == 0 and "READY" in out and "flex_attention compile" in out and "torch" in out
    assert "8 per GPU rank (64 cores / 8 rank(s) here" in out and "empty: a first run compiles cold" in out
    (tmp_path / "inductor" / "fxgraph").mkdir(parents=True, exist_ok=True)
    (tmp_path / "inductor" / "fxgraph" / "entry").write_bytes(b"x" * 3 * 2**20)
    assert "3 MiB of compiled code" in cache_check().detail


def test_inductor_compiles_get_the_layer_options_and_other_backends_none(monkeypatch):
    """Every inductor compile gets INDUCTOR_OPTIONS (a caller's own options win); a test backend (eager,
    aot_eager) takes no inductor options."""
    seen = {}
    real_compile = torch.compile
    monkeypatch.setenv(compile_layer.COLD_COMPILE_LEVERS_ENV, "1")  # on trial: off by default

    def spy(fn, **kwargs):
        seen[kwargs.get("backend")] = kwargs.get("options")
        return real_compile(fn, **kwargs)

    monkeypatch.setattr(torch, "compile", spy)
    monkeypatch.setattr(compile_layer, "_compiled", {})
    double = compile_layer.compiled("test_double_eager", lambda x: x * 2, backend="eager")
    assert torch.equal(double(torch.ones(3)), torch.full((3,), 2.0))
    compile_layer.compiled("test_double_inductor", lambda x: x * 2, dynamic=True)
    compile_layer.compiled("test_double_inductor_own", lambda x: x * 2, backend="inductor",
                           options={"triton.autotune_pointwise": True, "max_autotune": False})
    assert seen["eager"] is None
    assert compile_layer.INDUCTOR_OPTIONS == {"triton.autotune_pointwise": False,
                                              "triton.mix_order_reduction_non_strict_mode": True}
    assert seen[None] == {**compile_layer.INDUCTOR_OPTIONS, "pattern_matcher": False}  # the cold-compile levers
    assert seen["inductor"] == {"triton.autotune_pointwise": True, "max_autotune": False, "pattern_matcher": False,
                                "triton.mix_order_reduction_non_strict_mode": True}
    monkeypatch.setenv(compile_layer.COLD_COMPILE_LEVERS_ENV, "0")  # the A/B switch: inductor's own passes
    compile_layer.compiled("test_double_inductor_levers_off", lambda x: x * 2, dynamic=True)
    assert seen[None] == compile_layer.INDUCTOR_OPTIONS
    monkeypatch.delenv(compile_layer.COLD_COMPILE_LEVERS_ENV)  # the default: off
    compile_layer.compiled("test_double_inductor_default", lambda x: x * 2, dynamic=True)
    assert seen[None] == compile_layer.INDUCTOR_OPTIONS
    monkeypatch.setenv(compile_layer.COLD_COMPILE_LEVERS_ENV, "off")
    with pytest.raises(ValueError, match="DFLASH_TRAIN_COLD_COMPILE_LEVERS='off': set 1"):
        compile_layer.compiled("test_double_inductor_bad_switch", lambda x: x * 2, dynamic=True)


def test_the_cold_compile_options_hold_inside_the_compile_and_are_restored_after(monkeypatch):
    """A real inductor compile (CPU) through the compile layer sees the levers in inductor's config, forward and
    backward graph alike (a post-grad pass of our own records them), computes what eager does, and leaves the
    process's config as it was."""
    import torch._inductor.config as inductor_config

    monkeypatch.setattr(compile_layer, "_compiled", {})
    monkeypatch.setenv(compile_layer.COLD_COMPILE_LEVERS_ENV, "1")
    seen = []

    def record(graph):
        seen.append(inductor_config.pattern_matcher)

    before = inductor_config.pattern_matcher
    fn = compile_layer.compiled("test_levers_inside", lambda x: (x * 2 + 1).sin(), dynamic=True,
                                options={"post_grad_custom_post_pass": record})
    x = torch.randn(5, 3, requires_grad=True)
    out = fn(x)
    out.sum().backward()
    assert seen == [False, False]  # forward and backward graph
    assert inductor_config.pattern_matcher is before is True
    reference = x.detach().clone().requires_grad_()
    torch.testing.assert_close(out, (reference * 2 + 1).sin())
    (reference * 2 + 1).sin().sum().backward()
    torch.testing.assert_close(x.grad, reference.grad)


def test_the_cache_keys_hash_in_a_thread_joined_by_the_first_compiled_call(monkeypatch):
    """`start_compile_workers` starts hashing inductor's cache keys in a background thread (levers on); the first
    compiled call waits for it, so nothing compiles while it runs, and the key is then computed; levers off:
    no thread."""
    import torch._inductor.config as inductor_config
    from torch._inductor import codecache

    monkeypatch.setenv("TORCH_WARM_POOL", "0")
    monkeypatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", "1")
    monkeypatch.setattr(compile_layer, "_prefetch", {"thread": None, "done": False})
    threads = inductor_config.compile_threads  # restored by assignment: pytest's undo breaks this config entry
    try:
        monkeypatch.setenv(compile_layer.COLD_COMPILE_LEVERS_ENV, "0")
        compile_layer.start_compile_workers()
        assert compile_layer._prefetch["thread"] is None
        monkeypatch.setenv(compile_layer.COLD_COMPILE_LEVERS_ENV, "1")
        compile_layer.start_compile_workers()
    finally:
        inductor_config.compile_threads = threads
    thread = compile_layer._prefetch["thread"]
    assert thread is not None and thread.name == "dflash-prefetch-cache-keys"
    double = compile_layer.compiled("test_double_after_prefetch", lambda x: x * 2, backend="eager")
    assert torch.equal(double(torch.ones(2)), torch.full((2,), 2.0))
    assert not thread.is_alive() and compile_layer._prefetch == {"thread": None, "done": True}
    assert isinstance(codecache.torch_key(), bytes)
    compile_layer.prefetch_cache_keys()  # once per process
    assert compile_layer._prefetch["thread"] is None


def test_compile_workers_share_the_cores_between_the_ranks_of_a_machine(monkeypatch):
    """Eight ranks on 64 cores start 8 compile workers each, not inductor's min(32, cores); the user's
    TORCHINDUCTOR_COMPILE_THREADS wins."""
    import os

    import torch._inductor.config as inductor_config

    # Restored by assignment: monkeypatch's undo of a torch config entry deletes it ("compile_threads does not
    # exist" in every later inductor compile of the session).
    threads = inductor_config.compile_threads
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)), raising=False)
    monkeypatch.delenv("TORCHINDUCTOR_COMPILE_THREADS", raising=False)
    monkeypatch.setenv("TORCH_WARM_POOL", "0")  # sizes only: no worker processes in this test
    try:
        assert compile_layer.start_compile_workers(local_ranks=8) == 8
        assert compile_layer.start_compile_workers(local_ranks=1) == 32
        assert compile_layer.start_compile_workers(local_ranks=128) == 1
        monkeypatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", "3")
        inductor_config.compile_threads = None  # decided again, from the environment
        assert compile_layer.start_compile_workers(local_ranks=8) == 3
    finally:
        inductor_config.compile_threads = threads
