"""The precompile fan-out of the throughput benchmark (benchmarks/precompile_fanout.py) and the compile layer's
`restrict_to`: child processes that each compile a share of the graphs into one shared cache, and a parent that then
takes every graph from it. Real subprocesses, real inductor on the CPU."""

import importlib.util
import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SRC = Path(__file__).parents[2] / "src"
_spec = importlib.util.spec_from_file_location("precompile_fanout",
                                               Path(__file__).parents[2] / "benchmarks" / "precompile_fanout.py")
_fanout = sys.modules["precompile_fanout"] = importlib.util.module_from_spec(_spec)  # dataclasses look it up
_spec.loader.exec_module(_fanout)
Fanout = _fanout.Fanout
WORKER = Path(__file__).parents[1] / "helpers" / "_aot_cache_worker.py"


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": str(SRC)}


def _last_json(text: str) -> dict:
    return json.loads(text.strip().splitlines()[-1])


def test_restrict_to_leaves_the_other_functions_eager_and_must_come_first():
    script = textwrap.dedent("""
        from dflash_train.accel import compile as c
        def fn(x):
            return x + 1
        c.restrict_to(("keep",))
        assert c.compiled("drop_me", fn) is fn, "a function outside the share must stay eager"
        assert c.compiled("keep_me", fn, backend="eager") is not fn, "a function in the share must compile"
        try:
            c.restrict_to(("other",))
        except RuntimeError as e:
            assert "call it first" in str(e), e
        else:
            raise AssertionError("restrict_to after a compile must raise")
        print("ok")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=_env(), timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


def test_a_failed_or_late_child_is_named_with_its_log_and_the_parent_goes_on(tmp_path, caplog):
    commands = {"fails": [sys.executable, "-c", "import sys; print('no CUDA device here'); sys.exit(3)"],
                "hangs": [sys.executable, "-c", "import time; time.sleep(60)"],
                "works": [sys.executable, "-c", "print('done')"]}
    with caplog.at_level(logging.WARNING, logger="precompile_fanout"):
        with Fanout.start(commands, tmp_path / "logs", tmp_path / "cache", workers_each=1) as fan:
            info = fan.wait(timeout_s=3)
    assert sorted(info["precompile_failed"]) == ["fails", "hangs"], info
    assert set(info["precompile_child_s"]) == {"fails", "works"}, info
    assert all(c.process.poll() is not None for c in fan.children), "a late child must be stopped"
    text = caplog.text
    assert "fails failed (exit 3)" in text and "no CUDA device here" in text, text
    assert "hangs ran past 3 s" in text and str(tmp_path / "logs" / "hangs.log") in text, text
    assert (tmp_path / "logs" / "works.log").read_text().strip() == "done"


def _fails():
    raise RuntimeError("no CUDA device here")


def test_forked_children_run_their_jobs_and_a_failure_is_named_with_its_traceback(tmp_path, caplog):
    import time

    jobs = {"works": lambda: print("done"), "fails": _fails, "hangs": lambda: time.sleep(60)}
    with caplog.at_level(logging.WARNING, logger="precompile_fanout"):
        with Fanout.fork(jobs, tmp_path / "logs", tmp_path / "cache", workers_each=1) as fan:
            info = fan.wait(timeout_s=3)
    assert sorted(info["precompile_failed"]) == ["fails", "hangs"], info
    assert (tmp_path / "logs" / "works.log").read_text().strip() == "done"
    assert "fails failed (exit 1)" in caplog.text and "RuntimeError: no CUDA device here" in caplog.text, caplog.text
    assert "hangs ran past 3 s" in caplog.text, caplog.text
    assert all(c.process.poll() is not None for c in fan.children)


@pytest.mark.long
def test_children_compile_shares_that_the_parent_takes_whole_from_the_cache(tmp_path):
    """Two children each compile one of the drafter layer's two graph families (the other runs eagerly there); the
    parent, compiling everything, then finds every graph in the cache: an eager neighbour does not change a
    compiled function's graph, so the shares' cache keys are the parent's."""
    cache = tmp_path / "cache"
    commands = {name: [sys.executable, str(WORKER), str(cache), str(tmp_path / f"{name}.pt"), only]
                for name, only in (("inputs", "attention_inputs"), ("rest", "output_and_mlp"))}
    with Fanout.start(commands, tmp_path / "logs", cache, workers_each=1, env={"PYTHONPATH": str(SRC)}) as fan:
        info = fan.wait(timeout_s=900)
    assert info["precompile_failed"] == [], [(c.name, c.log_path.read_text()[-2000:]) for c in fan.children]
    children = {c.name: _last_json(c.log_path.read_text()) for c in fan.children}
    for name, stats in children.items():  # each compiled something, and only its share: the shares add up below
        assert stats["aot_cache_miss"] >= 1 and stats["aot_cache_hit"] == 0, (name, stats)
    parent = subprocess.run([sys.executable, str(WORKER), str(cache), str(tmp_path / "parent.pt")],
                            capture_output=True, text=True, env=_env(), timeout=900)
    assert parent.returncode == 0, parent.stderr[-3000:]
    stats = _last_json(parent.stdout)
    assert stats["aot_cache_miss"] == stats["aot_cache_bypass"] == stats["fxgraph_cache_miss"] == 0, stats
    assert stats["aot_cache_hit"] == sum(c["aot_cache_miss"] for c in children.values()), (stats, children)
    assert stats["graphs"] == sum(c["graphs"] for c in children.values()), (stats, children)
