"""Checkpoints written in the background (train/checkpoint.py `CheckpointWriter`): the loop pays for a snapshot to
host memory, a thread writes the files. In process: the files are those of the synchronous path byte for byte, the
snapshot is the state at the save (not at the write), one write in flight (a long wait is logged), a failed write
survived once (a second in a row raised) naming the path and the intact checkpoint. With real subprocesses, a write slowed down by
DFLASH_TEST_CHECKPOINT_WRITE_DELAY: training goes on while a checkpoint is written; SIGKILL in the middle of the
write leaves the previous checkpoint intact and `--resume` exact; SIGTERM waits for the write in flight."""

from __future__ import annotations

import errno
import json
import logging
import os
import signal
import time
from pathlib import Path

import pytest
import torch

from _harness import assert_same_losses, beat, launch, losses, status, stop, wait_until, write_config
from dflash_train.cli import main
from dflash_train.errors import UserError
from dflash_train.files.layout import STATE, list_checkpoints
from dflash_train.architectures import architecture
from dflash_train.architectures.io import load_drafter, save_drafter
from dflash_train.train import checkpoint as ck
from dflash_train.train.checkpoint import (WRITE_DELAY_ENV, CheckpointWriteError, CheckpointWriter, HostStaging,
                                           Snapshot, load_optimizer_state, newest_valid, read_state)
from dflash_train.files.io import write_json_atomic
from dflash_train.files.io import hidden_old_name

from conftest import tiny_drafter

STEPS = 12


def _trained(seed: int = 0, steps: int = 2):
    """A tiny drafter with AdamW state (fused, as the trainer's) and a LambdaLR, after `steps` steps."""
    drafter = tiny_drafter(seed)
    opt = torch.optim.AdamW(drafter.parameters(), lr=1e-3, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
    for _ in range(steps):
        _step(drafter, opt, sched)
    return drafter, opt, sched


def _step(drafter, opt, sched) -> None:
    for p in drafter.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    sched.step()


def test_a_background_checkpoint_is_byte_identical_to_the_synchronous_format(tmp_path):
    """The old synchronous writer's files (save_drafter float32, torch.save of the state dicts, the record) and the
    background writer's are the same bytes: resume and export read old and new checkpoints alike."""
    drafter, opt, sched = _trained()
    old = tmp_path / "old"
    old.mkdir()
    save_drafter(drafter, old / "drafter", dtype="float32")
    ck._save_torch({"optimizer": opt.state_dict(), "scheduler": sched.state_dict()}, old / "optimizer.pt")
    record = {"epoch": 1, "batch_index": 7, "skipped_steps": 0, "best_val_tau": None}
    write_json_atomic(old / STATE, {"step": 2, **record})
    writer = CheckpointWriter(tmp_path / "ckpts", keep_last=3)
    new = writer.save(2, drafter, opt, sched, record)
    assert writer.wait() == new and new.name == "step-00000002"
    names = sorted(str(p.relative_to(old)) for p in old.rglob("*") if p.is_file())
    assert names == sorted(str(p.relative_to(new)) for p in new.rglob("*") if p.is_file())
    for name in names:
        assert (old / name).read_bytes() == (new / name).read_bytes(), name


def test_the_snapshot_is_the_state_at_the_save_not_at_the_write(tmp_path, monkeypatch):
    drafter, opt, sched = _trained()
    want_weights = {k: v.clone() for k, v in drafter.state_dict().items()}
    want_opt = {i: {k: v.clone() for k, v in s.items()} for i, s in opt.state_dict()["state"].items()}
    want_lr = sched.state_dict()["_last_lr"]
    monkeypatch.setenv(WRITE_DELAY_ENV, "0.3")
    writer = CheckpointWriter(tmp_path, keep_last=3)
    final = writer.save(2, drafter, opt, sched, {"epoch": 0})
    assert writer.in_flight == final and not final.exists()  # the write goes on in the background
    for _ in range(3):  # training goes on meanwhile: weights, moments, step count and lr all change
        _step(drafter, opt, sched)
    writer.wait()
    saved = load_drafter(final / "drafter").state_dict()
    assert all(torch.equal(saved[k], want_weights[k]) for k in want_weights)
    assert not all(torch.equal(saved[k], v) for k, v in drafter.state_dict().items())
    state = load_optimizer_state(final)
    for i, s in want_opt.items():
        for k, v in s.items():
            assert torch.equal(state["optimizer"]["state"][i][k], v), (i, k)
    assert state["scheduler"]["_last_lr"] == want_lr and read_state(final)["step"] == 2


def test_one_write_in_flight_a_long_wait_is_logged_and_the_last_k_kept(tmp_path, monkeypatch, caplog):
    drafter, opt, sched = _trained()
    monkeypatch.setenv(WRITE_DELAY_ENV, "0.1")  # 3 sleeps a write
    monkeypatch.setattr(ck, "WAIT_LOG_S", 0.05)
    writer = CheckpointWriter(tmp_path, keep_last=2)
    caplog.set_level(logging.INFO, logger=ck.__name__)
    for step in (1, 2, 3, 4):
        writer.save(step, drafter, opt, sched, {"epoch": 0})
        # the previous write is complete before a new one starts; this one is not yet
        assert [p.name for p in list_checkpoints(tmp_path)][-1:] == ([] if step == 1 else [f"step-{step - 1:08d}"])
        assert writer.in_flight == tmp_path / f"step-{step:08d}"
    writer.wait()
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-00000003", "step-00000004"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    waits = [r.getMessage() for r in caplog.records if "waited" in r.getMessage()]
    assert len(waits) >= 3 and "for the previous one" in waits[0] and "step-00000001" in waits[0], waits
    t = writer.timings()
    assert t["checkpoint_stall_s"] > 0 and t["checkpoint_write_s"] >= 4 * 0.3, t
    assert writer.timings() == {}  # handed out once


def test_one_failed_background_write_is_survived_and_a_second_in_a_row_is_raised(tmp_path, monkeypatch):
    drafter, opt, sched = _trained()
    writer = CheckpointWriter(tmp_path, keep_last=3)
    first = writer.save(4, drafter, opt, sched, {"epoch": 0})
    writer.wait()

    def full(*_a, **_k):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(ck, "write_json_atomic", full)
    writer.save(8, drafter, opt, sched, {"epoch": 0})  # returns at once: the error is the thread's
    wait_until(lambda: writer.in_flight is None, _Alive(), 30, "the write to end")
    writer.check()  # the first failure: logged and handed out once, not raised
    failed = writer.take_failure()
    assert isinstance(failed, CheckpointWriteError) and writer.take_failure() is None
    msg = str(failed)
    assert f"could not write checkpoint {tmp_path / 'step-00000008'}" in msg and "[Errno 28] No space left" in msg
    assert f"The newest complete checkpoint, {first}, is intact" in msg and "--resume" in msg
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000004"] and newest_valid(tmp_path) == first

    writer.save(12, drafter, opt, sched, {"epoch": 0})  # fails again: now every step since 4 is at stake
    wait_until(lambda: writer.in_flight is None, _Alive(), 30, "the write to end")
    with pytest.raises(CheckpointWriteError, match="step-00000012"):
        writer.check()
    writer.check()  # raised once

    monkeypatch.undo()  # the disk has room again: a failure after a success counts as a first one again
    writer.save(16, drafter, opt, sched, {"epoch": 0}, wait=True)
    monkeypatch.setattr(ck, "write_json_atomic", full)
    writer.save(20, drafter, opt, sched, {"epoch": 0})
    wait_until(lambda: writer.in_flight is None, _Alive(), 30, "the write to end")
    writer.check()
    assert "step-00000020" in str(writer.take_failure())
    monkeypatch.undo()
    writer.save(24, drafter, opt, sched, {"epoch": 0}, wait=True)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-00000004", "step-00000016", "step-00000024"]


def test_a_stop_or_the_end_raises_the_failure_of_the_write_it_waits_for(tmp_path, monkeypatch):
    """The checkpoint of a stop or of the run's end is the one --resume needs: its failure is never survived."""
    drafter, opt, sched = _trained()
    writer = CheckpointWriter(tmp_path, keep_last=3)

    def full(*_a, **_k):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(ck, "write_json_atomic", full)
    with pytest.raises(CheckpointWriteError, match="step-00000004"):
        writer.save(4, drafter, opt, sched, {"epoch": 0}, wait=True)
    assert list_checkpoints(tmp_path) == []


class _Alive:
    def poll(self):
        return None


def test_a_checkpoint_moved_aside_by_a_killed_rewrite_is_put_back(tmp_path):
    """A kill between the two renames of a rewrite (`best` moved to `.best.old`, the new one not yet in place)
    leaves the old one aside: the next save puts it back instead of deleting it."""
    drafter, opt, sched = _trained()
    writer = CheckpointWriter(tmp_path, keep_last=3)
    writer.save(4, drafter, opt, sched, {"epoch": 0, "tag": "best at 4"}, name="best", wait=True)
    (tmp_path / "best").rename(hidden_old_name(tmp_path / "best"))  # where replace_dir keeps it meanwhile
    writer.save(8, drafter, opt, sched, {"epoch": 0}, wait=True)
    assert read_state(tmp_path / "best")["tag"] == "best at 4"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best", "step-00000008"]
    (tmp_path / "best").rename(tmp_path / ".best.old")  # the name an earlier version's writer used
    writer.save(12, drafter, opt, sched, {"epoch": 0}, wait=True)
    assert read_state(tmp_path / "best")["tag"] == "best at 4"


def test_host_buffers_are_allocated_once_and_reused():
    """On CUDA a snapshot copies into host buffers (pinned there) kept for the next one; a tensor that changes
    shape or dtype gets a new buffer. On the CPU a snapshot is plain clones and keeps no buffers."""
    staging = HostStaging(pin=False)
    a = staging.buffer("k", torch.Size([2, 3]), torch.float32)
    assert staging.buffer("k", torch.Size([2, 3]), torch.float32) is a
    assert staging.buffer("k", torch.Size([3, 3]), torch.float32) is not a
    assert staging.buffer("k", torch.Size([3, 3]), torch.bfloat16).dtype == torch.bfloat16
    staging = HostStaging()
    t = torch.arange(6.0)
    c = staging.copy("k", t)
    assert torch.equal(c, t) and c.data_ptr() != t.data_ptr() and staging.buffers == {}
    snap = Snapshot.take(1, *_trained(), {"epoch": 0}, staging=staging)
    assert snap.ready is None and snap.nbytes > 0 and snap.stall_s > 0 and staging.buffers == {}


def test_buffers_staged_after_the_first_step_are_the_ones_every_snapshot_uses(tmp_path):
    """`CheckpointWriter.stage` allocates, in a thread, exactly the buffers a snapshot copies into (the CUDA path,
    run here on host buffers): the first save then allocates none, and its files hold the state at the save."""
    drafter, opt, sched = _trained()
    writer = CheckpointWriter(tmp_path, keep_last=2, staging=HostStaging(pin=False, buffered=True))
    writer.stage(drafter, opt, sched)
    while writer.is_staging:
        time.sleep(0.01)
    staged = dict(writer.staging.buffers)
    assert len(staged) == len(ck.snapshot_tensors(drafter, opt, sched)) > len(drafter.state_dict())
    for p in drafter.parameters():
        p.data.add_(1.0)  # the state changes after the staging: the snapshot must copy the new values
    writer.save(3, drafter, opt, sched, {"epoch": 0}, wait=True)
    assert writer.staging.buffers.keys() == staged.keys()
    assert all(writer.staging.buffers[k] is staged[k] for k in staged)  # nothing reallocated
    loaded = load_drafter(tmp_path / "step-00000003" / "drafter")
    for name, v in drafter.state_dict().items():
        assert torch.equal(loaded.state_dict()[name].float(), v.float()), name
    state = ck.load_optimizer_state(tmp_path / "step-00000003")["optimizer"]["state"]
    assert all(torch.equal(state[i]["exp_avg"], opt.state_dict()["state"][i]["exp_avg"]) for i in state)


def test_the_preflight_counts_the_snapshot_and_refuses_a_host_without_room_for_it():
    from dflash_train.train.plan import preflight

    drafter, opt, sched = _trained()
    need = preflight.snapshot_need(architecture("dflash"), drafter.config)
    assert need.total == Snapshot.take(2, drafter, opt, sched, {}).nbytes  # what a save really copies
    assert need.optimizer == 2 * need.weights + 4 * len(list(drafter.parameters()))
    preflight.check_host_snapshot(need, 0, memory=lambda: (need.total, 2 * need.total))
    preflight.check_host_snapshot(need, 0, memory=lambda: None)  # unknown: not checked
    with pytest.raises(UserError) as e:  # the user's to fix: one message, exit 2, no traceback
        preflight.check_host_snapshot(need, 0, memory=lambda: (need.total - 1, 2**30))
    msg = str(e.value)
    gib = need.total / 2**30
    assert msg.startswith(f"preflight: rank 0 needs about {gib:.1f} GiB of host memory for a checkpoint snapshot"), msg
    assert "of 1.0 GiB are available (MemAvailable in /proc/meminfo)" in msg and "smaller drafter" in msg, msg
    available, total = preflight.host_memory()
    assert 0 < available <= total


# ------------------------------------------------------------------------ real runs, a slowed-down writer


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_target_dir, counting_jsonl):
    root = tmp_path_factory.mktemp("async")
    cfg = write_config(root / "c.yaml", tiny_target_dir, counting_jsonl, run__save_every=4)
    ref = root / "ref"
    assert main(["train", str(cfg), "--run-dir", str(ref), "--max-steps", str(STEPS)]) == 0  # in this process
    return root, cfg, losses(ref)


SLOW = {WRITE_DELAY_ENV: "1.0"}  # 3 files a checkpoint: about 3 s a write, 0.1 s a step


def _mid_write(run_dir: Path, step: int):
    """The checkpoint of `step` is half written: its drafter/ is in the temp folder, optimizer.pt not yet."""
    tmp = run_dir / "checkpoints" / f".step-{step:08d}.tmp"
    return (tmp / "drafter" / "model.safetensors").is_file() and not (tmp / "optimizer.pt").exists()


@pytest.mark.long  # ~12 s: a real process killed mid-write
@pytest.mark.slow
def test_sigkill_in_the_middle_of_a_background_write_keeps_the_previous_checkpoint(setup):
    root, cfg, ref = setup
    run_dir, log = root / "kill", root / "kill.log"
    proc = launch(["train", str(cfg), "--run-dir", str(run_dir), "--max-steps", str(STEPS)], log, env=SLOW)
    try:
        wait_until(lambda: _mid_write(run_dir, 8), proc, 180, "the step-8 checkpoint half written", interval=0.01)
        # training went on past the save while its files are being written
        wait_until(lambda: (beat(run_dir, 0) or {}).get("step", 0) >= 9, proc, 30, "step 9")
        assert _mid_write(run_dir, 8)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        stop(proc)
    ckpts = run_dir / "checkpoints"
    assert [p.name for p in list_checkpoints(ckpts)] == ["step-00000004"]
    assert newest_valid(ckpts) == ckpts / "step-00000004" and (ckpts / ".step-00000008.tmp").is_dir()
    text = (run_dir / "train.log").read_text()
    assert "waited" in text and "for the previous one (" in text, text[-3000:]  # step 8 waited for step 4's write
    assert main(["train", "--run-dir", str(run_dir), "--resume"]) == 0  # in this process, as the killed one's
    assert_same_losses(ref, losses(run_dir), STEPS)
    assert [p.name for p in list_checkpoints(ckpts)] == ["step-00000004", "step-00000008", "step-00000012"]
    assert not [p for p in ckpts.iterdir() if p.name.startswith(".")]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    at = {r["step"]: r for r in records if "loss" in r}
    # a save comes after its step's record: the next record carries what it cost
    assert at[9]["checkpoint_stall_s"] > 0 and "checkpoint_stall_s" not in at[8]
    assert sum(r.get("checkpoint_write_s", 0) for r in records) > 0


@pytest.mark.long  # ~20 s: real processes and signals
@pytest.mark.slow
def test_sigterm_and_the_end_of_the_run_wait_for_the_write_in_flight(setup, monkeypatch):
    root, cfg, ref = setup
    run_dir, log = root / "term", root / "term.log"
    proc = launch(["train", str(cfg), "--run-dir", str(run_dir), "--max-steps", str(STEPS)], log, env=SLOW)
    try:
        wait_until(lambda: _mid_write(run_dir, 4), proc, 180, "the step-4 checkpoint half written", interval=0.01)
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=60)
    finally:
        stop(proc)
    st = status(run_dir)
    assert rc == 3 and st["phase"] == "stopped", (rc, st)
    ckpts = run_dir / "checkpoints"
    stopped = Path(st["checkpoint"])
    # the write in flight finished (and a save the loop had reached meanwhile), then the stop's own checkpoint was
    # written before the exit
    names = [p.name for p in list_checkpoints(ckpts)]
    assert names[0] == "step-00000004" and names[-1] == stopped.name > "step-00000004", (names, stopped)
    assert read_state(stopped)["step"] == st["step"] and newest_valid(ckpts) == stopped
    assert not [p for p in ckpts.iterdir() if p.name.startswith(".")]
    monkeypatch.setenv(WRITE_DELAY_ENV, SLOW[WRITE_DELAY_ENV])  # the resume, slowed, in this process
    assert main(["train", "--run-dir", str(run_dir), "--resume"]) == 0
    assert status(run_dir)["phase"] == "done"
    assert_same_losses(ref, losses(run_dir), STEPS)
    last = ckpts / f"step-{STEPS:08d}"  # its slowed write was waited for before the exit
    assert read_state(last)["step"] == STEPS and (run_dir / "export" / "model.safetensors").is_file()
    assert not [p for p in ckpts.iterdir() if p.name.startswith(".")]
