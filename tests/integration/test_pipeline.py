"""The stage runner (`dflash_train.commands.pipeline`): done stages skipped, failed ones run again, one recipe per
root, times kept over calls. The stages are real functions writing real files; each one appends its name
to a log file when it runs, so the tests read what ran from disk."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from dflash_train.commands.pipeline import RecipeMismatch, Stage, StageRunner, Unfinished


def _ran(root: Path) -> list[str]:
    log = root / "ran.log"
    return log.read_text().split() if log.is_file() else []


def _stage(root: Path, name: str, fail_while: Path | None = None, unfinished_while: Path | None = None,
           sleep: float = 0.0, key=None) -> Stage:
    """A stage that logs its run, writes `root/NAME.out` and returns its text; it raises while the file
    `fail_while` exists, and raises Unfinished while `unfinished_while` exists."""
    out = root / f"{name}.out"

    def run():
        with open(root / "ran.log", "a") as f:
            f.write(name + "\n")
        time.sleep(sleep)
        if fail_while is not None and fail_while.exists():
            raise RuntimeError(f"{name} broke")
        if unfinished_while is not None and unfinished_while.exists():
            raise Unfinished("the deadline came")
        out.write_text(f"made by {name}")
        return out.read_text()

    return Stage(name, run, outputs=(out,), key=key, reuse=lambda: out.read_text())


def _runner(root: Path, recipe=None, **kw) -> tuple[StageRunner, list[str]]:
    said: list[str] = []
    return StageRunner(root, recipe if recipe is not None else {"steps": 8}, say=said.append, **kw), said


def test_done_stages_are_skipped_and_their_results_reused(tmp_path):
    root = tmp_path / "root"
    stages = lambda: [_stage(root, "prepare"), _stage(root, "train"), _stage(root, "eval")]  # noqa: E731
    runner, said = _runner(root)
    first = runner.run(stages())
    assert _ran(root) == ["prepare", "train", "eval"]
    assert [o.status for o in first.outcomes] == ["ran"] * 3 and first.finished
    assert first.result("train") == "made by train"
    assert "prepare ..." in said and any(s.startswith("prepare done in") for s in said)

    runner, said = _runner(root)  # a second call: nothing runs, the results come from the files
    second = runner.run(stages())
    assert _ran(root) == ["prepare", "train", "eval"]
    assert [o.status for o in second.outcomes] == ["skipped"] * 3 and second.finished
    assert second.result("eval") == "made by eval"
    assert any(s.startswith("train: done in an earlier call") and s.endswith("skipped") for s in said)
    assert said[-1].startswith("stages: prepare skipped (done earlier in")


def test_a_failed_stage_runs_again_and_the_stages_after_it_too(tmp_path):
    root = tmp_path / "root"
    broken = tmp_path / "broken"
    broken.touch()
    stages = lambda: [_stage(root, "prepare"), _stage(root, "train", fail_while=broken), _stage(root, "eval")]  # noqa: E731
    runner, said = _runner(root)
    with pytest.raises(RuntimeError, match="train broke"):
        runner.run(stages())
    assert _ran(root) == ["prepare", "train"]
    state = json.loads((root / "pipeline.json").read_text())
    assert state["stages"]["prepare"]["done"] is True
    assert state["stages"]["train"]["done"] is False
    assert state["stages"]["train"]["last"] == "failed: RuntimeError: train broke"
    assert "eval" not in state["stages"]
    assert any("train failed after" in s and "the next call runs it again" in s for s in said)

    broken.unlink()
    report = _runner(root)[0].run(stages())
    assert _ran(root) == ["prepare", "train", "train", "eval"]
    assert [o.status for o in report.outcomes] == ["skipped", "ran", "ran"]
    state = json.loads((root / "pipeline.json").read_text())
    assert state["stages"]["train"]["done"] is True and state["stages"]["train"]["calls"] == 2


def test_a_stage_runs_again_when_its_key_changed_or_its_output_is_gone(tmp_path):
    root = tmp_path / "root"
    stages = lambda key: [_stage(root, "prepare", key=key), _stage(root, "train"), _stage(root, "eval")]  # noqa: E731
    _runner(root)[0].run(stages({"data": ("a.jsonl",)}))
    _runner(root)[0].run(stages({"data": ["a.jsonl"]}))  # the same key as JSON reads it back: all skipped
    assert _ran(root) == ["prepare", "train", "eval"]

    runner, said = _runner(root)
    report = runner.run(stages({"data": ["b.jsonl"]}))  # another key: prepare again, and what comes after it
    assert _ran(root)[3:] == ["prepare", "train", "eval"]
    assert [o.status for o in report.outcomes] == ["ran"] * 3
    assert "prepare: done in an earlier call with other inputs: running it again" in said
    assert "train: done in an earlier call, but prepare ran before it: running it again" in said

    (root / "eval.out").unlink()  # an output removed by hand: that stage runs again, the others not
    runner, said = _runner(root)
    report = runner.run(stages({"data": ["b.jsonl"]}))
    assert _ran(root)[6:] == ["eval"] and (root / "eval.out").is_file()
    assert f"eval: done in an earlier call, but {root / 'eval.out'} is missing: running it again" in said


def test_a_key_function_is_read_when_the_runner_reaches_its_stage(tmp_path):
    """A key may depend on what the stages before it make (the quality driver keys its eval by the trained
    drafter's weights): it is read after they ran, and recorded as the stage ran with it."""
    root = tmp_path / "root"
    weights = root / "train.out"
    stages = lambda: [_stage(root, "train"), Stage("eval", lambda: weights.read_text(),  # noqa: E731
                                                   key=lambda: {"weights": weights.read_text()})]
    first = _runner(root)[0].run(stages())
    assert first.result("eval") == "made by train"
    assert json.loads((root / "pipeline.json").read_text())["stages"]["eval"]["key"] == {"weights": "made by train"}
    assert [o.status for o in _runner(root)[0].run(stages()).outcomes] == ["skipped", "skipped"]
    weights.write_text("retrained elsewhere")  # same files, other content: the eval runs again, train does not
    runner, said = _runner(root)
    assert [o.status for o in runner.run(stages()).outcomes] == ["skipped", "ran"]
    assert "eval: done in an earlier call with other inputs: running it again" in said


def test_a_root_of_another_recipe_is_refused_naming_what_differs(tmp_path):
    root = tmp_path / "root"
    recipe = {"recipe_version": 2, "size": {"steps": 8, "prompts": 24}, "overrides": ["optim.lr=1e-3"]}
    _runner(root, recipe)[0].run([_stage(root, "prepare")])
    _runner(root, json.loads(json.dumps(recipe)))  # the same recipe (as read back from JSON): accepted
    before = (root / "pipeline.json").read_text()
    other = {**recipe, "size": {"steps": 9, "prompts": 24}, "overrides": ["optim.lr=2e-3"]}
    with pytest.raises(RecipeMismatch) as e:
        StageRunner(root, other, label="demo", remedy="remove it or pass --run-dir NEW_DIR")
    msg = str(e.value)
    assert msg.startswith(f"{root} holds a demo made with another recipe or other overrides (")
    assert "overrides: ['optim.lr=1e-3'] there, ['optim.lr=2e-3'] here" in msg
    assert "size.steps: 8 there, 9 here" in msg and "prompts" not in msg
    assert msg.endswith("; remove it or pass --run-dir NEW_DIR")
    assert isinstance(e.value, ValueError)  # the CLI prints it as one line, exit code 2
    with pytest.raises(RecipeMismatch, match=r"extra: \(none\) there, 1 here"):
        StageRunner(root, {**recipe, "extra": 1})
    assert (root / "pipeline.json").read_text() == before  # a refused start writes nothing

    old = tmp_path / "old"  # files but no state file: an earlier version's directory
    old.mkdir()
    (old / "regen.jsonl").write_text("{}\n")
    with pytest.raises(RecipeMismatch, match=f"{old} holds files from an earlier demo version \\(no demo.json\\)"):
        StageRunner(old, recipe, state_file="demo.json", label="demo")
    assert not (old / "demo.json").exists()
    adopted = StageRunner(old, recipe, state_file="demo.json", adopt_unstamped=True)  # a caller may take it over
    assert json.loads((old / "demo.json").read_text())["recipe"] == recipe and adopted.stage_record("x") == {}

    (old / "demo.json").write_text("{not json")
    with pytest.raises(RecipeMismatch, match="demo.json is not valid JSON"):
        StageRunner(old, recipe, state_file="demo.json")


def test_a_bare_recipe_stamp_is_read_as_that_recipe_with_nothing_done(tmp_path):
    """What the demo wrote before the stage runner (demo.json = the recipe alone) resumes: not refused."""
    root = tmp_path / "root"
    root.mkdir()
    recipe = {"recipe_version": 2, "size": {"steps": 8}, "overrides": []}
    (root / "demo.json").write_text(json.dumps(recipe, indent=1))
    (root / "regen.jsonl").write_text("{}\n")
    runner = StageRunner(root, recipe, state_file="demo.json", say=lambda m: None)
    assert runner.run([_stage(root, "regen")]).outcomes[0].status == "ran"  # no stage was marked done
    state = json.loads((root / "demo.json").read_text())
    assert state["recipe"] == recipe and state["stages"]["regen"]["done"] is True
    (root / "demo.json").write_text(json.dumps({**recipe, "overrides": ["x=1"]}))
    with pytest.raises(RecipeMismatch, match=r"overrides: \['x=1'\] there, \[\] here"):
        StageRunner(root, recipe, state_file="demo.json")


def test_times_are_kept_over_calls_and_a_deadline_ends_the_call(tmp_path):
    root = tmp_path / "root"
    later = tmp_path / "stop-early"
    later.touch()
    stages = lambda: [_stage(root, "train", unfinished_while=later, sleep=0.2), _stage(root, "eval")]  # noqa: E731
    runner, said = _runner(root)
    runner.add_time("train_s:variant", 1.5)
    report = runner.run(stages())
    assert not report.finished and [o.status for o in report.outcomes] == ["unfinished"]
    assert report.outcomes[0].reason == "the deadline came" and report.outcomes[0].seconds >= 0.2
    assert _ran(root) == ["train"]  # eval never started
    assert any(s.startswith("train: not finished after") and s.endswith("the deadline came") for s in said)
    rec = json.loads((root / "pipeline.json").read_text())["stages"]["train"]
    assert rec["done"] is False and rec["last"] == "unfinished: the deadline came" and rec["seconds"] >= 0.2

    later.unlink()
    runner, _ = _runner(root)
    runner.add_time("train_s:variant", 2.0)
    report = runner.run(stages())
    assert report.finished and _ran(root) == ["train", "train", "eval"]
    state = json.loads((root / "pipeline.json").read_text())
    assert state["stages"]["train"]["seconds"] >= 0.4 and state["stages"]["train"]["calls"] == 2  # both calls
    assert report.outcomes[0].total_s == pytest.approx(state["stages"]["train"]["seconds"], abs=0.01)
    assert state["times"] == {"train_s:variant": 3.5} == runner.times

    # a stage that needs more time than is left is not started; the call ends unfinished
    root2 = tmp_path / "root2"
    runner, said = _runner(root2, deadline=time.time() + 30)
    assert 0 < runner.remaining() <= 30
    slow = Stage("eval", lambda: pytest.fail("must not start"), min_remaining_s=100)
    report = runner.run([_stage(root2, "prepare"), slow, _stage(root2, "summary")])
    assert [o.status for o in report.outcomes] == ["ran", "unfinished"] and _ran(root2) == ["prepare"]
    assert "too little time left before the deadline" in report.outcomes[1].reason
    assert any(s.startswith("eval: not started: too little time left") for s in said)
    assert _runner(tmp_path / "root3")[0].remaining() == float("inf")
