"""Storage faults while a run writes checkpoints: the disk fills mid-write, a file outgrows the file-size
limit, the checkpoint directory becomes unwritable. Tests run as root, and root ignores permission bits,
so each fault is one that really fails for root:

- file-size limit: RLIMIT_FSIZE lowered on the running trainer with prlimit(2) after its first
  checkpoint (SIGXFSZ ignored, so write() fails with EFBIG instead of killing it), once below the
  size of model.safetensors and once below optimizer.pt;
- disk full: a tmpfs mounted on RUN/checkpoints that holds one and a half checkpoints (ENOSPC);
  needs mount rights, skipped without them;
- unwritable directory: `chattr +i` on RUN/checkpoints (EPERM even for root; skipped where the
  filesystem has no immutable flag), and RUN/checkpoints replaced by a regular file (ENOTDIR, anywhere).

Default CI runs the optimizer.pt size limit, the tmpfs and the regular-file cases; `pytest -m chaos` adds
the model.safetensors size limit and the immutable directory.

Each fault lasts: the first save it hits fails, the run reports it (status `checkpoint_error`) and trains on; the
next save fails too and the run stops as `failed` with an error naming the checkpoint path and the OS error,
leaves no temp folder, keeps the checkpoint before the fault valid (newest_valid returns it) and, where checked,
`--resume`s from it to exactly the losses of an uninterrupted run. A fault that passes (one save's temp folder
blocked) costs that checkpoint only: the run ends `done` with the same losses.
"""

from __future__ import annotations

import errno
import json
import os
import resource
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from _harness import assert_same_losses, launch, losses, run, status, stop, wait_until, write_config
from dflash_train.files.layout import list_checkpoints
from dflash_train.architectures.io import load_drafter
from dflash_train.cli import main
from dflash_train.train.checkpoint import CheckpointWriteError, newest_valid, read_state, save_checkpoint

pytestmark = pytest.mark.slow

STEPS = 12


def _ignore_sigxfsz() -> None:  # preexec_fn: write() past RLIMIT_FSIZE returns EFBIG instead of killing
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_target_dir, counting_jsonl):
    root = tmp_path_factory.mktemp("faults")
    cfg = write_config(root / "c.yaml", tiny_target_dir, counting_jsonl, run__save_every=4)
    ref = root / "ref"
    assert main(["train", str(cfg), "--run-dir", str(ref), "--max-steps", str(STEPS)]) == 0  # in this process
    ckpt = list_checkpoints(ref / "checkpoints")[-1]
    sizes = {"model.safetensors": (ckpt / "drafter" / "model.safetensors").stat().st_size,
             "optimizer.pt": (ckpt / "optimizer.pt").stat().st_size,
             "total": sum(p.stat().st_size for p in ckpt.rglob("*") if p.is_file())}
    return root, cfg, losses(ref), sizes


def _start_and_wait_for_first_checkpoint(cfg: Path, run_dir: Path, log: Path, **popen) -> subprocess.Popen:
    proc = launch(["train", str(cfg), "--run-dir", str(run_dir), "--max-steps", str(STEPS)], log, **popen)
    wait_until(lambda: list_checkpoints(run_dir / "checkpoints"), proc, 120, "the first checkpoint", interval=0.005)
    return proc


def _assert_failed_clearly(run_dir: Path, proc: subprocess.Popen, os_error: str, t_fault: float) -> Path:
    """The run stops within seconds as failed, naming the checkpoint it could not write and the OS error;
    no temp folder is left; the newest complete checkpoint is older than the failed one and loads."""
    rc = proc.wait(timeout=60)
    took = time.time() - t_fault
    st = status(run_dir)
    err = st["error"] or {}
    assert rc == 2 and st["phase"] == "failed", (rc, st["phase"], err)
    assert err["type"] == "CheckpointWriteError", err
    msg = err["message"]
    assert "could not write checkpoint" in msg and os_error in msg and "--resume" in msg, msg
    failed = Path(msg.split("could not write checkpoint ", 1)[1].split(":", 1)[0])
    assert failed.parent == run_dir / "checkpoints" and failed.name.startswith("step-"), msg
    survived = st.get("checkpoint_error") or ""  # the first save the fault hit: reported, and training went on
    first = Path(survived.split("could not write checkpoint ", 1)[-1].split(":", 1)[0])
    assert os_error in survived and first.parent == failed.parent and first.name < failed.name, (survived, msg)
    good = newest_valid(run_dir / "checkpoints")
    assert good is not None and good.name < failed.name and str(good) in msg, (good, msg)
    assert not failed.exists()
    assert not [p for p in (run_dir / "checkpoints").iterdir() if p.name.startswith(".")], "temp folder left"
    load_drafter(good / "drafter")
    torch.load(good / "optimizer.pt", map_location="cpu", weights_only=True)
    print(f"fault -> failed in {took:.1f} s: {msg}")
    return good


@pytest.mark.parametrize("victim", [pytest.param("model.safetensors", marks=pytest.mark.chaos), "optimizer.pt"])
def test_file_size_limit_mid_run_fails_clearly_and_resume_is_exact(setup, victim):
    root, cfg, ref, sizes = setup
    # A limit under the victim's size and over every file written before it (and over the logs).
    limit = sizes["model.safetensors"] // 2 if victim == "model.safetensors" else \
        (sizes["model.safetensors"] + sizes["optimizer.pt"]) // 2
    assert sizes["optimizer.pt"] > limit or victim == "model.safetensors"
    run_dir = root / f"fsize-{victim}"
    proc = _start_and_wait_for_first_checkpoint(cfg, run_dir, root / f"fsize-{victim}.log", preexec_fn=_ignore_sigxfsz)
    try:
        resource.prlimit(proc.pid, resource.RLIMIT_FSIZE, (limit, limit))
        t0 = time.time()
        _assert_failed_clearly(run_dir, proc, "File too large", t0)
    finally:
        stop(proc)
    if victim == "optimizer.pt":  # torch.save's own error says only "unexpected pos"; ours names the errno
        assert "[Errno 27]" in status(run_dir)["error"]["message"]
    assert main(["train", str(cfg), "--run-dir", str(run_dir), "--max-steps", str(STEPS), "--resume"]) == 0
    assert status(run_dir)["phase"] == "done"
    assert_same_losses(ref, losses(run_dir), STEPS)


def test_a_save_that_fails_once_costs_that_checkpoint_only(setup):
    """The temp folder of the step-8 save is taken by a regular file (mkdir fails with EEXIST): that save fails,
    the status and train.log say so, training goes on, the step-12 save is written, and the run ends `done` with
    the losses of an uninterrupted run."""
    root, cfg, ref, _ = setup
    run_dir = root / "once"
    proc = _start_and_wait_for_first_checkpoint(cfg, run_dir, root / "once.log")
    try:
        (run_dir / "checkpoints" / ".step-00000008.tmp").write_text("in the way")
        assert proc.wait(timeout=60) == 0
    finally:
        stop(proc)
    st = status(run_dir)
    assert st["phase"] == "done", st
    survived = st["checkpoint_error"]
    assert f"could not write checkpoint {run_dir / 'checkpoints' / 'step-00000008'}" in survived, survived
    assert "File exists" in survived and "step-00000004" in survived, survived
    assert "Training goes on" in (run_dir / "train.log").read_text()
    assert [p.name for p in list_checkpoints(run_dir / "checkpoints")] == ["step-00000004", "step-00000012"]
    assert_same_losses(ref, losses(run_dir), STEPS)


@pytest.mark.long  # ~13 s: a whole run before the failing export
def test_an_export_that_cannot_be_written_names_the_checkpoint_to_export_from(setup, tmp_path):
    """RUN/export is a regular file and the name it would be moved aside to a non-empty folder (EISDIR), once
    training runs: the run ends `failed` (exit 2) with the export's path and error, the last checkpoint written,
    and the command it names writes the export."""
    root, cfg, _, _ = setup
    run_dir = root / "export-blocked"
    proc = _start_and_wait_for_first_checkpoint(cfg, run_dir, root / "export-blocked.log")
    try:
        pid = json.loads((run_dir / "heartbeats" / "rank-0.json").read_text())["pid"]
        (run_dir / f".export.old-{pid}" / "x").mkdir(parents=True)
        (run_dir / "export").write_text("in the way")
        rc = proc.wait(timeout=60)
    finally:
        stop(proc)
    st = status(run_dir)
    err = st["error"] or {}
    assert rc == 2 and st["phase"] == "failed" and err["type"] == "ExportWriteError", (rc, st)
    msg = err["message"]
    last = run_dir / "checkpoints" / f"step-{STEPS:08d}"
    assert f"could not write the export {run_dir / 'export'}" in msg and f"checkpoint {last} is intact" in msg, msg
    assert newest_valid(run_dir / "checkpoints") == last
    command = msg.split("`dflash-train ", 1)[1].split("`", 1)[0].split()
    assert command[:2] == ["export", str(last)], command
    out = tmp_path / "export"
    assert run([*command[:2], "--out", str(out)], root / "export-blocked.log") == 0
    load_drafter(out)


def _mount_tmpfs(path: Path, size: int) -> None:
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.decode().strip()})")


@pytest.mark.long
def test_disk_full_mid_write_fails_clearly_and_resume_after_growing_the_disk(setup):
    """A real ENOSPC: RUN/checkpoints is a tmpfs with room for one and a half checkpoints. The second
    checkpoint fills it mid-write; after the disk grows (remount), --resume continues exactly."""
    root, cfg, ref, sizes = setup
    run_dir = root / "enospc"
    ck = run_dir / "checkpoints"
    ck.mkdir(parents=True)
    _mount_tmpfs(ck, (sizes["total"] * 3 // 2) // 4096 * 4096)
    try:
        keep1 = write_config(root / "keep1.yaml", *_target_and_data(cfg), run__save_every=4, run__keep_last=1)
        proc = _start_and_wait_for_first_checkpoint(keep1, run_dir, root / "enospc.log")
        try:
            good = _assert_failed_clearly(run_dir, proc, "No space left on device", time.time())
        finally:
            stop(proc)
        assert good.name == "step-00000004"
        subprocess.run(["mount", "-o", f"remount,size={sizes['total'] * 8}", str(ck)], check=True)
        assert run(["train", str(keep1), "--run-dir", str(run_dir), "--max-steps", str(STEPS), "--resume"],
                   root / "enospc.log") == 0
        assert_same_losses(ref, losses(run_dir), STEPS)
        assert [p.name for p in list_checkpoints(ck)] == [f"step-{STEPS:08d}"]
    finally:
        subprocess.run(["umount", "-l", str(ck)], capture_output=True)


def _target_and_data(cfg: Path) -> tuple[Path, Path]:
    import yaml

    c = yaml.safe_load(cfg.read_text())
    return Path(c["target"]["path"]), Path(c["data"]["train_files"][0])


@pytest.mark.chaos
def test_immutable_checkpoint_directory_fails_clearly(setup):
    """`chattr +i`: nothing can be created in the directory, not even by root (EPERM)."""
    root, cfg, ref, _ = setup
    run_dir = root / "immutable"
    ck = run_dir / "checkpoints"
    proc = _start_and_wait_for_first_checkpoint(cfg, run_dir, root / "immutable.log")
    try:
        r = subprocess.run(["chattr", "+i", str(ck)], capture_output=True)
        if r.returncode != 0:
            stop(proc)
            pytest.skip(f"no immutable flag here ({r.stderr.decode().strip()})")
        try:
            _assert_failed_clearly(run_dir, proc, "Operation not permitted", time.time())
        finally:
            subprocess.run(["chattr", "-i", str(ck)], capture_output=True)
    finally:
        stop(proc)
    assert run(["train", str(cfg), "--run-dir", str(run_dir), "--max-steps", str(STEPS), "--resume"],
               root / "immutable.log") == 0
    assert_same_losses(ref, losses(run_dir), STEPS)


def test_checkpoint_directory_replaced_by_a_file_fails_clearly(setup):
    """Portable (any user, any filesystem): RUN/checkpoints becomes a regular file mid-run (ENOTDIR).
    The checkpoints moved aside are intact and resumable once the directory is back."""
    root, cfg, _, _ = setup
    run_dir = root / "notdir"
    ck = run_dir / "checkpoints"
    proc = _start_and_wait_for_first_checkpoint(cfg, run_dir, root / "notdir.log")
    try:
        aside = run_dir / "checkpoints.aside"
        ck.rename(aside)
        ck.write_text("not a directory")
        t0 = time.time()
        rc = proc.wait(timeout=60)
    finally:
        stop(proc)
    st = status(run_dir)
    msg = st["error"]["message"]
    assert rc == 2 and st["phase"] == "failed" and st["error"]["type"] == "CheckpointWriteError", st
    assert f"could not write checkpoint {ck}/step-" in msg and "Not a directory" in msg, msg
    print(f"fault -> failed in {time.time() - t0:.1f} s: {msg}")
    ck.unlink()
    aside.rename(ck)
    good = newest_valid(ck)
    assert good is not None and good == list_checkpoints(ck)[-1]
    load_drafter(good / "drafter")


@pytest.mark.chaos
def test_two_rank_run_reports_the_checkpoint_error(setup):
    """With the launcher: rank 0 cannot write its checkpoints; the launcher stops rank 1, and the status keeps
    rank 0's own error (a user error: path, OS error, intact checkpoint) and names the rank."""
    root, cfg, _, sizes = setup
    run_dir = root / "two-ranks"
    limit = (sizes["model.safetensors"] + sizes["optimizer.pt"]) // 2
    proc = launch(["train", str(cfg), "--run-dir", str(run_dir), "--max-steps", str(STEPS), "--nproc", "2"],
                  root / "two-ranks.log")
    try:
        wait_until(lambda: list_checkpoints(run_dir / "checkpoints"), proc, 120, "the first checkpoint", interval=0.005)
        rank0 = json.loads((run_dir / "heartbeats" / "rank-0.json").read_text())["pid"]
        resource.prlimit(rank0, resource.RLIMIT_FSIZE, (limit, limit))
        rc = proc.wait(timeout=60)
    finally:
        stop(proc)
    st = status(run_dir)
    err = st["error"]
    print(f"two ranks: {err['type']}: {err['message']}")
    assert rc == 2 and st["phase"] == "failed" and st["failed_rank"] == 0, st
    assert err["type"] == "CheckpointWriteError" and "File too large" in err["message"], err
    assert "could not write checkpoint" in err["message"] and "--resume" in err["message"], err
    assert newest_valid(run_dir / "checkpoints") == list_checkpoints(run_dir / "checkpoints")[-1]


# ------------------------------------------------------------------------ save_checkpoint in process


@pytest.fixture
def parts(setup):
    """A drafter, optimizer and scheduler as the trainer holds them (from the reference checkpoint)."""
    root, *_ = setup
    ckpt = list_checkpoints(root / "ref" / "checkpoints")[-1]
    drafter = load_drafter(ckpt / "drafter")
    opt = torch.optim.AdamW(drafter.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    return drafter, opt, sched


def test_a_failed_write_leaves_nothing_and_names_the_errno(parts, tmp_path, monkeypatch):
    drafter, opt, sched = parts
    first = save_checkpoint(tmp_path, 4, drafter, opt, sched, {"epoch": 0}, keep_last=3)
    import dflash_train.train.checkpoint as ck

    def full(*_a, **_k):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp_path / ".step-00000008.tmp" / "optimizer.pt"))

    monkeypatch.setattr(ck, "write_json_atomic", full)
    with pytest.raises(CheckpointWriteError) as e:
        save_checkpoint(tmp_path, 8, drafter, opt, sched, {"epoch": 0}, keep_last=3)
    msg = str(e.value)
    assert f"could not write checkpoint {tmp_path / 'step-00000008'}" in msg and "[Errno 28] No space left" in msg
    assert f"The newest complete checkpoint, {first}, is intact" in msg
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000004"]
    assert newest_valid(tmp_path) == first and read_state(first)["step"] == 4


def test_rewriting_the_same_checkpoint_never_loses_it(parts, tmp_path, monkeypatch):
    """Saving a step that exists (a resumed run's last step, or `best`): the old one is moved aside, not
    deleted first, and comes back if the new one cannot be put in place."""
    drafter, opt, sched = parts
    first = save_checkpoint(tmp_path, 8, drafter, opt, sched, {"epoch": 0, "tag": "old"}, keep_last=3)
    real = os.replace
    failed = []

    def fail_rename(src, dst):  # the new folder's rename into place fails once
        if Path(dst) == first and Path(src).name.endswith(".tmp") and not failed:
            failed.append(src)
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real(src, dst)

    monkeypatch.setattr(os, "replace", fail_rename)
    with pytest.raises(CheckpointWriteError, match="Input/output error"):
        save_checkpoint(tmp_path, 8, drafter, opt, sched, {"epoch": 0, "tag": "new"}, keep_last=3)
    assert failed and read_state(first)["tag"] == "old" and newest_valid(tmp_path) == first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000008"]
    monkeypatch.undo()
    save_checkpoint(tmp_path, 8, drafter, opt, sched, {"epoch": 0, "tag": "new"}, keep_last=3)
    assert read_state(first)["tag"] == "new" and sorted(p.name for p in tmp_path.iterdir()) == ["step-00000008"]


def test_temp_folders_of_killed_writes_are_cleared_by_the_next_save(parts, tmp_path):
    drafter, opt, sched = parts
    (tmp_path / ".step-00000003.tmp" / "drafter").mkdir(parents=True)  # a rank killed mid-write
    (tmp_path / ".best.old").mkdir()
    save_checkpoint(tmp_path, 8, drafter, opt, sched, {"epoch": 0}, keep_last=3)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000008"]
