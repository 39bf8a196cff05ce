"""Processes over gloo on CPU: colocated data parallel, fail fast on a killed rank, exact resume,
SIGTERM checkpoints, corrupt and incompatible checkpoints refused, non-finite steps skipped."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from _harness import losses as _losses, write_config as _config

from dflash_train.cli import main

pytestmark = pytest.mark.slow


def _launch(args: list[str], log: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "dflash_train", *args], stdout=open(log, "wb"),
                            stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONUNBUFFERED="1"))


def _wait_for_step(run: Path, rank: int, step: int, proc: subprocess.Popen, timeout: float = 180) -> dict:
    deadline = time.time() + timeout
    beat_file = run / "heartbeats" / f"rank-{rank}.json"
    while time.time() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"run ended early with {proc.returncode}")
        try:
            beat = json.loads(beat_file.read_text())
            if beat["phase"] == "training" and beat["step"] >= step:
                return beat
        except (OSError, json.JSONDecodeError, KeyError):
            pass
        time.sleep(0.05)
    raise AssertionError(f"rank {rank} never reached step {step}")


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_target_dir, counting_jsonl):
    root = tmp_path_factory.mktemp("dist")
    cfg = _config(root / "c.yaml", tiny_target_dir, counting_jsonl)
    return root, cfg


@pytest.fixture(scope="module")
def reference(setup):
    """Two ranks, uninterrupted, 16 steps."""
    root, cfg = setup
    run = root / "ref"
    assert main(["train", str(cfg), "--run-dir", str(run), "--max-steps", "16", "--nproc", "2"]) == 0
    return run


def test_colocated_two_ranks_finish_and_report_both_heartbeats(reference, capsys):
    status = json.loads((reference / "status.json").read_text())
    assert status["phase"] == "done" and status["world_size"] == 2 and status["step"] == 16
    assert sorted(_losses(reference)) == list(range(1, 17))
    capsys.readouterr()
    assert main(["status", str(reference)]) == 0
    out = capsys.readouterr().out
    assert "rank 0: colocated done" in out and "rank 1: colocated done" in out


@pytest.mark.long  # ~21 s: two ranks in real processes, one killed, then a resume
def test_killed_rank_stops_the_run_fast_and_resume_matches(setup, reference):
    root, cfg = setup
    run = root / "killed"
    proc = _launch(["train", str(cfg), "--run-dir", str(run), "--max-steps", "16", "--nproc", "2"], root / "killed.log")
    beat = _wait_for_step(run, 1, 6, proc)
    os.kill(beat["pid"], signal.SIGKILL)
    t0 = time.time()
    rc = proc.wait(timeout=60)
    assert rc != 0 and time.time() - t0 < 15, (rc, time.time() - t0)
    status = json.loads((run / "status.json").read_text())
    assert status["phase"] == "failed" and status["failed_rank"] == 1
    assert "rank 1 killed by signal 9" in status["error"]["message"]
    assert main(["train", str(cfg), "--run-dir", str(run), "--max-steps", "16", "--nproc", "2", "--resume"]) == 0
    ref, got = _losses(reference), _losses(run)
    assert sorted(got) == list(range(1, 17))
    assert all(got[s] == pytest.approx(ref[s], rel=1e-6, abs=1e-7) for s in ref), {s: (ref[s], got[s]) for s in ref}


@pytest.mark.long  # by default: test_async_checkpoint's SIGTERM (a write in flight), stopped and resumed exactly
def test_sigterm_leaves_a_valid_checkpoint_and_resume_is_exact(setup, tmp_path):
    root, _ = setup
    cfg = yaml.safe_load((root / "c.yaml").read_text())
    single = _config(tmp_path / "s.yaml", Path(cfg["target"]["path"]), Path(cfg["data"]["train_files"][0]))
    ref = tmp_path / "ref"
    assert main(["train", str(single), "--run-dir", str(ref), "--max-steps", "12"]) == 0
    run = tmp_path / "term"
    proc = _launch(["train", str(single), "--run-dir", str(run), "--max-steps", "12"], tmp_path / "term.log")
    _wait_for_step(run, 0, 5, proc)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 3  # stopped before done
    status = json.loads((run / "status.json").read_text())
    assert status["phase"] == "stopped"
    stopped_at = status["step"]
    assert (Path(status["checkpoint"]) / "trainer_state.json").is_file()
    assert main(["train", str(single), "--run-dir", str(run), "--max-steps", "12", "--resume"]) == 0
    a, b = _losses(ref), _losses(run)
    assert sorted(b) == list(range(1, 13)) and stopped_at < 12
    assert all(b[s] == pytest.approx(a[s], rel=1e-6, abs=1e-7) for s in a)


@pytest.mark.long  # by default: test_lifecycle's stop, then an exact resume
def test_stop_command_checkpoints_and_exits(setup, tmp_path, capsys):
    root, cfg = setup
    run = tmp_path / "stopme"
    proc = _launch(["train", str(cfg), "--run-dir", str(run), "--max-steps", "400"], tmp_path / "s.log")
    _wait_for_step(run, 0, 3, proc)
    assert main(["stop", str(run)]) == 0
    assert proc.wait(timeout=60) == 3
    assert json.loads((run / "status.json").read_text())["phase"] == "stopped"


def test_corrupt_checkpoint_is_skipped_and_incompatible_one_refused(setup, reference, tmp_path, capsys):
    import shutil

    root, cfg = setup
    run = tmp_path / "copy"
    shutil.copytree(reference, run)
    ckpts = sorted((run / "checkpoints").iterdir())
    newest = ckpts[-1]
    (newest / "drafter" / "model.safetensors").write_bytes(b"garbage")
    from dflash_train.train.checkpoint import newest_valid

    assert newest_valid(run / "checkpoints") == ckpts[-2]
    rc = main(["train", str(cfg), "--run-dir", str(run), "--resume", "--max-steps", "16", "drafter.num_draft_layers=2"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "'drafter.num_draft_layers' is 1" in err and "2 by the override drafter.num_draft_layers=2" in err
    # config.yaml changed by hand behind the run's back: the checkpoint's record names the key that differs
    edited = yaml.safe_load((run / "config.yaml").read_text())
    edited["drafter"]["num_draft_layers"] = 2
    (run / "config.yaml").write_text(yaml.safe_dump(edited))
    assert main(["train", "--run-dir", str(run), "--resume", "optim.max_steps=20"]) == 2
    err = capsys.readouterr().err
    assert "cannot resume" in err and "drafter_shape.num_hidden_layers: checkpoint 1, this run 2" in err, err


def test_non_finite_steps_are_skipped_then_the_run_stops(setup, tmp_path, capsys):
    root, cfg = setup
    run = tmp_path / "nan"
    with pytest.raises(FloatingPointError):
        main(["train", str(cfg), "--run-dir", str(run), "--max-steps", "30", "optim.lr=1e30", "optim.grad_clip=0"])
    status = json.loads((run / "status.json").read_text())
    assert status["phase"] == "failed" and "non-finite" in status["error"]["message"]


def test_detach_returns_at_once_and_status_follow_streams_to_the_end(setup, tmp_path, capsys):
    root, cfg = setup
    run = tmp_path / "bg"
    t0 = time.time()
    assert main(["train", str(cfg), "--run-dir", str(run), "--max-steps", "6", "--detach"]) == 0
    assert time.time() - t0 < 5
    assert "started in the background" in capsys.readouterr().out
    assert main(["status", str(run), "--follow", "--interval", "0.5"]) == 0  # at once: the run says it is starting
    out = capsys.readouterr().out
    assert "phase:      done" in out and (run / "launcher.out").is_file()


def _vote_rank(rank: int, init_file: str, out_dir: str) -> None:
    import torch
    import torch.distributed as dist

    from dflash_train.train.processes.dist import StopVote

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    vote = StopVote(torch.device("cpu"))
    asks = [False, False, rank == 1, rank == 1, False]  # rank 1 asks at the third call (and keeps asking)
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps([vote(ask) for ask in asks]))
    dist.destroy_process_group()


def test_stop_vote_agrees_on_every_rank_one_step_after_the_request(tmp_path):
    """One rank's request reaches every rank at the same later call (the vote never waits on the device:
    it returns the previous call's all-reduce)."""
    import torch.multiprocessing as mp

    mp.spawn(_vote_rank, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert got[0] == got[1] == [False, False, False, True, True]
