"""A short CPU training run through the CLI on a tiny random target, and `status` on its run dir."""

import json
from pathlib import Path

import pytest
import torch
import yaml

from dflash_train.cli import main
from dflash_train.architectures.io import load_drafter


def _write_config(path: Path, target: Path, data: Path, **extra) -> Path:
    cfg = {
        "target": {"path": str(target)},
        "drafter": {"num_draft_layers": 1, "block_size": 4, "attention_backend": "sdpa"},
        "data": {"train_files": [str(data)], "max_length": 256, "token_budget": 1024, "max_batch_size": 4},
        "objective": {"max_anchors": 16, "gamma": 4.0},
        "optim": {"lr": 3e-3, "epochs": 10, "warmup_ratio": 0.05},
        "run": {"device": "cpu", "log_every": 5, "save_every": 20, "keep_last": 2, "progress_bar": False},
    }
    for dotted, value in extra.items():
        section, key = dotted.split("__")
        cfg[section][key] = value
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, tiny_target_dir, counting_jsonl):
    root = tmp_path_factory.mktemp("run")
    cfg = _write_config(root / "tiny.yaml", tiny_target_dir, counting_jsonl)
    run_dir = root / "R"
    # a peak for the CPU, so that the MFU fields carry numbers (without one they are null on a CPU)
    rc = main(["train", str(cfg), "--run-dir", str(run_dir), "--max-steps", "30", "optim.lr=5e-3",
               "run.mfu_peak_tflops=0.5"])
    return rc, run_dir


def test_run_finishes_with_a_falling_loss(finished_run):
    rc, run_dir = finished_run
    assert rc == 0
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [5, 10, 15, 20, 25, 30]
    assert records[-1]["loss"] < records[0]["loss"] - 0.5
    for r in records:
        assert len(r["accuracy_per_position"]) == 3 and r["tokens_per_s"] > 0 and r["tau_estimate"] >= 1


def test_run_directory_layout(finished_run):
    _, run_dir = finished_run
    for name in ("config.yaml", "train.log", "metrics.jsonl", "status.json"):
        assert (run_dir / name).is_file(), name
    resolved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert resolved["optim"]["lr"] == 5e-3 and resolved["objective"]["gamma"] == 4.0 and "seed" in resolved["run"]
    status = json.loads((run_dir / "status.json").read_text())
    assert status["phase"] == "done" and status["step"] == 30 and status["error"] is None
    assert any((run_dir / "tensorboard").iterdir())
    ckpts = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert ckpts == ["step-00000020", "step-00000030"]
    state = json.loads((run_dir / "checkpoints" / "step-00000030" / "trainer_state.json").read_text())
    assert state["step"] == 30
    export = run_dir / "export"
    assert {"config.json", "model.safetensors", "README.md"} <= {p.name for p in export.iterdir()}
    drafter = load_drafter(export)
    assert drafter.block_size == 4 and drafter.mask_token_id == 16


def test_status_reads_the_run(finished_run, capsys):
    _, run_dir = finished_run
    capsys.readouterr()
    assert main(["status", str(run_dir)]) == 0
    out = capsys.readouterr().out
    for field in ("phase:      done", "step:       30 / 30", "tokens/s:", "loss:", "accuracy:", "heartbeat:", "last error: none",
                  "efficiency: ", "MFU ", "of 0.5 TFLOP/s", "blocks/s:   "):
        assert field in out, field


def test_metrics_carry_the_steps_flops_mfu_and_drafted_blocks(finished_run, tiny_target_dir):
    """Each record's efficiency fields (train/loop/flops.py, from host counts): the step's FLOPs are the capture's and
    the drafter's; MFU is the window's FLOPs over its time (tokens / tokens_per_s) and the peak; drafted blocks
    per second are the window's blocks over the same time; the target's share is the benchmark's formula for
    its rows through the last captured layer."""
    from dflash_train.architectures.drafter import default_target_layer_ids
    from dflash_train.train.loop import flops
    from dflash_train.target.capture import read_target_config

    _, run_dir = finished_run
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    shape = flops.model_shape(read_target_config(tiny_target_dir))
    layers = max(default_target_layer_ids(shape["num_hidden_layers"], 1)) + 1  # up to the last captured layer
    linears = 2 * flops.layer_matmul_params(shape) * layers  # a token's
    causal = 4 * shape["num_attention_heads"] * shape["head_dim"] * layers  # a (query, key) pair's
    for r in records:
        seconds, steps = r["tokens"] / r["tokens_per_s"], 5
        assert r["step_flops"] == pytest.approx(r["target_flops"] + r["drafter_flops"])
        assert r["target_flops"] > 0 and r["drafter_flops"] > 0 and r["mfu_peak_tflops"] == 0.5
        assert r["mfu"] == pytest.approx(r["step_flops"] * steps / seconds / 0.5e12)
        assert r["mfu"] == pytest.approx(r["target_mfu"] + r["drafter_mfu"])
        assert r["drafted_blocks_per_s"] == pytest.approx(r["drafted_blocks"] / seconds)
        assert 0 < r["drafted_blocks"] <= 16 * 4 * steps  # max_anchors a row, max_batch_size rows, 5 steps
        # a row of s tokens: s linears and s (s + 1) / 2 causal pairs, 1 <= (s + 1) / 2 <= (max_length + 1) / 2
        target = r["target_flops"] * steps
        assert r["tokens"] * (linears + causal) <= target <= r["tokens"] * (linears + causal * 257 / 2)


def test_a_start_refused_for_bad_data_leaves_no_trace_and_the_fixed_command_runs(tmp_path, tiny_target_dir,
                                                                                  counting_jsonl, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": "not a list"}\n{broken json\n')
    cfg = _write_config(tmp_path / "c.yaml", tiny_target_dir, bad)
    assert main(["train", str(cfg), "--run-dir", str(tmp_path / "R")]) == 2
    err = capsys.readouterr().err
    assert "no usable conversation" in err and "bad.jsonl:1" in err and "bad.jsonl:2" in err
    assert not (tmp_path / "R").exists()  # nothing of the refused start is left
    # The same command with the data fixed just works (no "already holds a run", no --overwrite needed).
    bad.write_text(counting_jsonl.read_text())
    assert main(["train", str(cfg), "--run-dir", str(tmp_path / "R"), "--max-steps", "2"]) == 0


def test_a_refused_start_keeps_what_was_in_the_directory_and_puts_an_overwritten_run_back(
        tmp_path, tiny_target_dir, counting_jsonl, capsys):
    good = _write_config(tmp_path / "good.yaml", tiny_target_dir, counting_jsonl)
    run_dir = tmp_path / "R"
    assert main(["train", str(good), "--run-dir", str(run_dir), "--max-steps", "2"]) == 0
    before = {p.relative_to(run_dir): p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file()}
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "only a prompt"}\n')
    cfg = _write_config(tmp_path / "c.yaml", tiny_target_dir, bad)
    assert main(["train", str(cfg), "--run-dir", str(run_dir), "--overwrite"]) == 2
    assert "no usable conversation" in capsys.readouterr().err
    after = {p.relative_to(run_dir): p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file()}
    assert after == before  # the old run is back where it was, byte for byte
    assert [p.name for p in tmp_path.iterdir() if ".old-" in p.name] == []
    # A folder the user made, with a file of theirs, keeps both.
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    assert main(["train", str(cfg), "--run-dir", str(mine)]) == 2
    assert sorted(p.name for p in mine.iterdir()) == ["notes.txt"]


def test_a_trace_left_by_a_refused_start_does_not_block_the_fixed_command(tmp_path, tiny_target_dir,
                                                                           counting_jsonl, capsys):
    """A detached or torchrun start cannot take its trace back; the next fresh start clears it (only it)."""
    from dflash_train.run.directory import RunDir
    from dflash_train.run.status import StatusWriter

    run = RunDir(tmp_path / "R").create()
    (run.root / "train.log").write_text("the failed start's log\n")
    (run.root / "notes.txt").write_text("a file of the user's")
    StatusWriter(run).fail(ValueError("no usable conversation in ['x']"), phase="loading")
    cfg = _write_config(tmp_path / "c.yaml", tiny_target_dir, counting_jsonl)
    assert main(["train", str(cfg), "--run-dir", str(run.root), "--max-steps", "2"]) == 0
    assert "removed the trace of an earlier start" in capsys.readouterr().out
    assert (run.root / "notes.txt").read_text() == "a file of the user's"
    # A run that failed for another reason (not the user's) is still a run: refused, as before.
    other = RunDir(tmp_path / "R2").create()
    StatusWriter(other).fail(RuntimeError("CUDA error"), phase="loading")
    assert main(["train", str(cfg), "--run-dir", str(other.root), "--max-steps", "2"]) == 2
    assert "already holds a run" in capsys.readouterr().err


def test_config_errors_fail_before_any_model_loads(tmp_path, tiny_target_dir, counting_jsonl, capsys):
    cfg = _write_config(tmp_path / "c.yaml", tiny_target_dir, counting_jsonl)
    assert main(["train", str(cfg), "--run-dir", str(tmp_path / "R1"), "objective.max_anchors=0"]) == 2
    assert "objective.max_anchors" in capsys.readouterr().err
    assert not (tmp_path / "R1").exists()
    assert main(["train", str(cfg), "--run-dir", str(tmp_path / "R2"), "drafter.target_layer_ids=[1,6]"]) == 2
    err = capsys.readouterr().err
    assert "drafter.target_layer_ids" in err and "6 decoder layers" in err
    assert not (tmp_path / "R2").exists()  # checked against the target's config.json: nothing written


def test_mask_token_must_not_be_pad_or_eos(tmp_path, tiny_target_dir, counting_jsonl, capsys):
    cfg = _write_config(tmp_path / "c.yaml", tiny_target_dir, counting_jsonl)
    assert main(["train", str(cfg), "--run-dir", str(tmp_path / "R"), "drafter.mask_token_id=2"]) == 2
    err = capsys.readouterr().err
    assert "mask_token_id=2" in err and ("eos" in err or "pad" in err)


def _weights(folder: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


def _same_weights(export: Path, checkpoint: Path) -> bool:
    """The export holds the checkpoint's (float32) weights cast to the export's dtype."""
    got, saved = _weights(export), _weights(checkpoint / "drafter")
    return got.keys() == saved.keys() and all(torch.equal(got[k], saved[k].to(got[k].dtype)) for k in got)


def test_the_run_exports_its_best_checkpoint_by_validation_tau_and_says_so(tmp_path, tiny_target_dir,
                                                                             counting_jsonl, capsys):
    cfg = _write_config(tmp_path / "c.yaml", tiny_target_dir, counting_jsonl, data__val_files=[str(counting_jsonl)],
                        run__eval_every=4, run__save_every=4, run__keep_last=5, run__eval_prompts=0,
                        run__eval_batches=1)  # one validation batch: the walk over each of its rows is the cost
    run_dir = tmp_path / "R"
    assert main(["train", str(cfg), "--run-dir", str(run_dir), "--max-steps", "8"]) == 0
    vals = [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
            if r.get("kind") == "validation"]
    assert [r["step"] for r in vals] == [4, 8]
    best = max(vals, key=lambda r: r["val_tau_walk"])  # the first of equals is the best (a tie does not replace it)
    card = (run_dir / "export" / "README.md").read_text()
    assert _same_weights(run_dir / "export", run_dir / "checkpoints" / f"step-{best['step']:08d}")
    assert f"step {best['step']}" in card or f"({best['step']})" in card
    # Resumed with a record no later validation beats: the run's export is checkpoints/best, an earlier step's.
    newest = run_dir / "checkpoints" / "step-00000008"
    state = json.loads((newest / "trainer_state.json").read_text())
    state["best_val_tau"] = 1e9
    (newest / "trainer_state.json").write_text(json.dumps(state))
    best_step = json.loads((run_dir / "checkpoints" / "best" / "trainer_state.json").read_text())["step"]
    assert main(["train", "--resume", "--run-dir", str(run_dir), "--max-steps", "12"]) == 0
    card = (run_dir / "export" / "README.md").read_text()
    assert f"the best checkpoint by validation tau: step {best_step}" in card and "of the 12 trained" in card
    assert _same_weights(run_dir / "export", run_dir / "checkpoints" / "best")
    assert not _same_weights(run_dir / "export", run_dir / "checkpoints" / "step-00000012")
    # `dflash-train export` says which weights a checkpoint holds, on the card and on its output.
    capsys.readouterr()
    assert main(["export", str(run_dir / "checkpoints" / "step-00000012"), "--out", str(tmp_path / "E")]) == 0
    out = capsys.readouterr().out
    assert f"step 12; the run's best by validation tau is step {best_step}" in out
    assert "step 12; the run's best" in (tmp_path / "E" / "README.md").read_text()
