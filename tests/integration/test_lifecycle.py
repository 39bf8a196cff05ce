"""The life of a run as a user lives it: run, repeat the same command, stop, resume, kill -9,
status, a refused resume, a recycled PID. Real subprocesses and signals on the tiny CPU target."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from _harness import ENV, assert_same_losses, launch, losses, status, wait_for_step, wait_until, write_config

from dflash_train.run import procs
from dflash_train.cli import main

pytestmark = pytest.mark.slow

STEPS = 12


def _snapshot(root: Path) -> dict[str, bytes]:
    """Every file of a run directory and its bytes."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _cli(args: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dflash_train", *args], capture_output=True, text=True,
                          env=ENV, timeout=timeout)


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_target_dir, counting_jsonl):
    root = tmp_path_factory.mktemp("life")
    cfg = write_config(root / "c.yaml", tiny_target_dir, counting_jsonl)
    return root, cfg


@pytest.fixture(scope="module")
def finished(setup):
    """An uninterrupted run of STEPS steps: the reference losses and a finished run directory to copy."""
    root, cfg = setup
    ref = root / "ref"
    assert main(["train", str(cfg), "--run-dir", str(ref), "--max-steps", str(STEPS)]) == 0
    return ref


def test_the_same_command_again_refuses_and_leaves_a_finished_run_byte_identical(setup, finished, tmp_path, capsys):
    _, cfg = setup
    run_dir = tmp_path / "R"
    shutil.copytree(finished, run_dir)
    before = _snapshot(run_dir)
    capsys.readouterr()
    assert main(["train", str(cfg), "--run-dir", str(run_dir), "--max-steps", str(STEPS)]) == 2
    err = capsys.readouterr().err
    assert "already holds a run" in err and "export/" in err and "--resume" in err and "--overwrite" in err, err
    assert _snapshot(run_dir) == before
    # --resume of a finished run with nothing to add: says so, touches nothing, exit 0
    assert main(["train", "--run-dir", str(run_dir), "--resume"]) == 0
    assert "already done" in capsys.readouterr().out
    assert _snapshot(run_dir) == before


def test_overwrite_moves_the_old_run_aside_and_never_deletes_it(setup, finished, tmp_path, capsys):
    _, cfg = setup
    run_dir = tmp_path / "R"
    shutil.copytree(finished, run_dir)
    before = _snapshot(run_dir)
    assert main(["train", str(cfg), "--run-dir", str(run_dir), "--max-steps", "4", "--overwrite"]) == 0
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("R.old-")]
    assert len(aside) == 1 and _snapshot(aside[0]) == before  # the finished run, whole, under its new name
    assert status(run_dir)["phase"] == "done" and status(run_dir)["step"] == 4


def test_a_refused_resume_writes_nothing(setup, finished, tmp_path, capsys):
    run_dir = tmp_path / "R"
    shutil.copytree(finished, run_dir)
    before = _snapshot(run_dir)
    capsys.readouterr()
    assert main(["train", "--run-dir", str(run_dir), "--resume", "drafter.num_draft_layers=2"]) == 2
    err = capsys.readouterr().err
    assert "'drafter.num_draft_layers' is 1" in err and "drafter.num_draft_layers=2" in err, err
    assert _snapshot(run_dir) == before  # config, status, metrics, checkpoints and export
    # the identity check behind it (config.yaml edited by hand) refuses before writing, too
    edited = yaml.safe_load((run_dir / "config.yaml").read_text())
    edited["drafter"]["block_size"] = 8
    (run_dir / "config.yaml").write_text(yaml.safe_dump(edited))
    before = _snapshot(run_dir)
    assert main(["train", "--run-dir", str(run_dir), "--resume", "optim.max_steps=20"]) == 2
    err = capsys.readouterr().err
    assert "drafter_shape.block_size: checkpoint 4, this run 8" in err, err
    assert _snapshot(run_dir) == before


def test_stop_then_resume_continues_exactly_and_the_stop_request_is_consumed(setup, finished, tmp_path, capsys):
    _, cfg = setup
    run_dir, log = tmp_path / "R", tmp_path / "r.log"
    proc = launch(["train", str(cfg), "--run-dir", str(run_dir), "--max-steps", str(STEPS)], log)
    try:
        wait_for_step(run_dir, 0, 3, proc)
        assert main(["stop", str(run_dir)]) == 0
        assert proc.wait(timeout=60) == 3, log.read_text()[-2000:]  # 3: stopped before done
    finally:
        if proc.poll() is None:
            proc.kill()
    st = status(run_dir)
    assert st["phase"] == "stopped" and st["step"] < STEPS
    assert not (run_dir / "STOP").exists()
    # the run's own config, one cadence change accepted, logged and recorded
    assert main(["train", "--run-dir", str(run_dir), "--resume", "run.log_every=2"]) == 0  # in this process
    assert status(run_dir)["phase"] == "done"
    got = losses(run_dir)
    ref = losses(finished)
    assert all(got[s] == pytest.approx(ref[s], rel=1e-6, abs=1e-7) for s in got), {s: (ref[s], got[s]) for s in got}
    assert max(got) == STEPS
    record = json.loads((run_dir / "resumes.jsonl").read_text().splitlines()[-1])
    assert record["changes"] == {"run.log_every": [1, 2]}
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["run"]["log_every"] == 2
    assert "--resume changes run.log_every: 1 -> 2" in (run_dir / "train.log").read_text()


def test_a_stale_stop_request_is_never_honoured_by_a_later_start(setup, tmp_path, capsys):
    _, cfg = setup
    run_dir = tmp_path / "R"
    run_dir.mkdir()
    (run_dir / "STOP").write_text(f"{time.time() - 60}\n")  # left by a run that died before consuming it
    assert main(["train", str(cfg), "--run-dir", str(run_dir), "--max-steps", "4"]) == 0
    assert f"watch it with: dflash-train status {run_dir}" in capsys.readouterr().out  # said once admitted
    assert status(run_dir)["phase"] == "done" and status(run_dir)["step"] == 4
    assert not (run_dir / "STOP").exists()


def test_kill_9_of_a_plain_train_shows_dead_within_seconds_and_resume_is_exact(setup, finished, tmp_path, capsys):
    _, cfg = setup
    run_dir, log = tmp_path / "R", tmp_path / "r.log"
    proc = launch(["train", str(cfg), "--run-dir", str(run_dir), "--max-steps", str(STEPS)], log)
    try:
        wait_for_step(run_dir, 0, 6, proc)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        killed_at = time.time()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert status(run_dir)["phase"] == "training"  # what the dead process left behind
    capsys.readouterr()
    assert main(["status", str(run_dir)]) == 1
    out = capsys.readouterr().out
    assert time.time() - killed_at < 5
    assert "phase:      dead (was training" in out and "is gone" in out and "last heartbeat" in out, out
    assert "ETA:        -" in out and "rank 0: colocated dead" in out, out
    assert main(["train", "--run-dir", str(run_dir), "--resume"]) == 0  # in this process
    assert_same_losses(losses(finished), losses(run_dir), STEPS)


def _detach(args: list[str]) -> int:
    """`train ... --detach` as a user types it; the PID of the process it started."""
    out = _cli([*args, "--detach"])
    assert out.returncode == 0 and "started in the background" in out.stdout, out.stdout + out.stderr
    return int(out.stdout.split("(pid ")[1].split(")")[0])


def _wait_gone(pid: int, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while procs.start_ticks(pid) is not None:  # None: no such process (or a zombie)
        assert time.time() < deadline, f"pid {pid} still running after {timeout} s"
        time.sleep(0.1)


def test_a_detached_run_is_a_run_directory_and_stops_cleanly_from_the_moment_detach_returns(setup, tmp_path,
                                                                                            capsys):
    """Right after `--detach` returns, while the new process is still importing: `status` says starting, and `stop`
    stops it (a signal that arrives before the process can take it waits for it), with nothing trained."""
    _, cfg = setup
    run_dir = tmp_path / "R"
    pid = _detach(["train", str(cfg), "--run-dir", str(run_dir), "--max-steps", str(STEPS)])
    capsys.readouterr()
    assert main(["status", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("phase:      starting (") and f"(pid {pid} on " in out, out
    assert main(["stop", str(run_dir)]) == 0
    assert "stops at once with nothing to checkpoint" in capsys.readouterr().out
    _wait_gone(pid)
    assert main(["status", str(run_dir)]) == 3
    out = capsys.readouterr().out
    assert out.startswith("phase:      stopped\n") and "stopped:    signal 15 before the run started" in out, out
    assert status(run_dir)["step"] == 0 and not (run_dir / "STOP").exists()
    assert not list((run_dir / "checkpoints").iterdir())
    assert "Traceback" not in (run_dir / "launcher.out").read_text()


def test_a_detached_start_killed_before_it_began_leaves_no_run_in_the_way(setup, tmp_path, capsys):
    """SIGKILL while the background process imports: `status` says dead, and the same command starts there (the
    record of a start that never began is a trace, like a refused start's)."""
    _, cfg = setup
    run_dir = tmp_path / "R"
    argv = ["train", str(cfg), "--run-dir", str(run_dir), "--max-steps", "2"]
    pid = _detach(argv)
    os.kill(pid, signal.SIGKILL)
    _wait_gone(pid)
    capsys.readouterr()
    assert main(["status", str(run_dir)]) == 1
    out = capsys.readouterr().out
    assert out.startswith("phase:      dead (was starting: ") and "run the same command again)" in out, out
    assert main(argv) == 0
    assert "removed the trace of an earlier start" in capsys.readouterr().out
    assert status(run_dir)["phase"] == "done"


def test_a_detached_start_refused_after_detach_returned_says_why_in_status(setup, tmp_path, capsys):
    """A check that needs the target runs in the background process: its refusal is in status.json, one line as
    the terminal would have shown it, and the same command, fixed, starts there."""
    _, cfg = setup
    run_dir = tmp_path / "R"
    pid = _detach(["train", str(cfg), "--run-dir", str(run_dir), "--max-steps", "2", "drafter.target_layer_ids=[1,60]"])
    capsys.readouterr()
    assert main(["status", str(run_dir), "--follow", "--interval", "0.5"]) == 1
    out = capsys.readouterr().out
    assert "last error: ConfigError: config key 'drafter.target_layer_ids': [1, 60] names layer 60" in out, out
    assert "Traceback" not in out, out
    _wait_gone(pid)
    assert main(["train", str(cfg), "--run-dir", str(run_dir), "--max-steps", "2"]) == 0


def test_stop_never_signals_a_recycled_pid(tmp_path, capsys):
    """A live process of ours that is not the run sits at the run's PID: in status.json (with another start time,
    as after PID reuse) and in launcher.pid."""

    bystander = subprocess.Popen(["sleep", "60"])
    try:
        run_dir = tmp_path / "R"
        run_dir.mkdir()
        ident = procs.identity()
        (run_dir / "status.json").write_text(json.dumps({
            "phase": "training", "step": 7, "heartbeat": time.time(), "pid": bystander.pid,
            "pid_start": procs.start_ticks(bystander.pid) - 1, "host": ident["host"]}))
        capsys.readouterr()
        assert main(["stop", str(run_dir)]) == 1
        assert "not running" in capsys.readouterr().out
        (run_dir / "launcher.pid").write_text(str(bystander.pid))
        del_start = json.loads((run_dir / "status.json").read_text())
        del del_start["pid_start"]  # an older record: only the command line can tell
        (run_dir / "status.json").write_text(json.dumps(del_start))
        assert main(["stop", str(run_dir)]) == 1
        assert "not running" in capsys.readouterr().out
        time.sleep(0.2)
        assert bystander.poll() is None  # never signalled
        assert not (run_dir / "STOP").exists()
    finally:
        bystander.kill()
        bystander.wait()


@pytest.mark.parametrize("args,expect", [
    (["drafter.target_layer_ids=[1,60]"], "drafter.target_layer_ids"),
    (["drafter.mask_token_id=2"], "mask_token_id=2"),
    (["target.path=/nonexistent/model"], "target.path"),
    (["data.train_files=[/nonexistent/data.jsonl]"], "data.train_files"),
    (["optim.lrr=1"], "override 'optim.lrr=1': unknown config key 'optim.lrr'"),
], ids=["layer-id", "eos-mask", "missing-target", "missing-data", "override-typo"])
def test_user_errors_are_one_clear_line_without_a_traceback(setup, tmp_path, args, expect, capsys):
    _, cfg = setup
    argv = ["train", str(cfg), "--run-dir", str(tmp_path / "R"), *args]
    if expect.startswith(("drafter.", "mask_token_id")):
        # found once the target's config and tokenizer are read: in this process (a new one spends ~6 s importing
        # torch and transformers first); the cases before them show what a user's process prints
        capsys.readouterr()
        code = main(argv)
        out = subprocess.CompletedProcess(argv, code, *capsys.readouterr())
    else:
        out = _cli(argv)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "watch it with" not in out.stdout, out.stdout  # a refused start is not announced as a run to watch
    assert expect in out.stderr and "Traceback" not in out.stderr, out.stderr
    if "override" in expect:
        assert str(cfg) not in out.stderr  # an override's mistake is not blamed on the YAML file
    assert not (tmp_path / "R").exists()
    if "target.path" in expect:  # the traceback is there for whoever asks (one case: each costs a process)
        debug = _cli(["--debug", "train", str(cfg), "--run-dir", str(tmp_path / "R"), *args])
        assert debug.returncode == 2 and "Traceback" in debug.stderr


def test_a_start_its_ranks_refuse_is_one_line_and_leaves_no_run(setup, tmp_path, capfd):
    """--nproc 2, refused by the ranks' checks against the target: rank 0's line is the one error, and what the start
    wrote is taken back, so that the same command, fixed, starts there."""
    _, cfg = setup
    run_dir = tmp_path / "R"
    argv = ["train", str(cfg), "--run-dir", str(run_dir), "--nproc", "2", "--max-steps", "2"]
    assert main([*argv, "drafter.target_layer_ids=[1,60]"]) == 2
    out, err = capfd.readouterr()
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert errors == ["error: config key 'drafter.target_layer_ids': [1, 60] names layer 60, but the target has 6 "
                      "decoder layers (valid ids 0..5)"], err
    assert "watch it with" not in out and not run_dir.exists()


def test_resume_without_a_run_or_a_checkpoint_says_so_at_once(setup, tmp_path, capsys):
    _, cfg = setup
    assert main(["train", "--run-dir", str(tmp_path / "nowhere"), "--resume"]) == 2
    assert "does not exist" in capsys.readouterr().err and not (tmp_path / "nowhere").exists()
    started = tmp_path / "R"
    started.mkdir()
    (started / "config.yaml").write_text((Path(cfg)).read_text())
    (started / "status.json").write_text(json.dumps({"phase": "failed", "failed_phase": "warmup", "step": 0}))
    assert main(["train", "--run-dir", str(started), "--resume"]) == 2
    err = capsys.readouterr().err
    assert "no checkpoint yet" in err and "failed in warmup" in err and "--overwrite" in err, err


def test_a_run_on_another_host_is_judged_by_its_pulse(tmp_path):
    """Where the kernel cannot be asked (another node), a run is alive while its files keep being touched and
    `silent` once they stop for longer than SILENT_S."""
    from dflash_train.run.status import SILENT_S, Pulse, format_status

    now = time.time()
    elsewhere = {"phase": "training", "step": 40, "total_steps": 100, "heartbeat": now - 30, "eta_s": 60,
                 "pid": 4242, "pid_start": 1, "host": "another-node"}
    assert format_status({**elsewhere, "alive_at": now - 1}, None, now).startswith("phase:      training\n")
    silent = format_status({**elsewhere, "alive_at": now - SILENT_S - 5}, None, now)
    assert silent.startswith("phase:      silent (was training: no sign of life for") and "ETA:        -" in silent

    beat = tmp_path / "rank-0.json"
    beat.write_text("{}")
    os.utime(beat, (now - 100, now - 100))
    pulse = Pulse([beat], interval=0.05).start()
    try:
        deadline = time.time() + 5
        while beat.stat().st_mtime < now - 1 and time.time() < deadline:
            time.sleep(0.02)
    finally:
        pulse.stop()
    assert beat.stat().st_mtime >= now - 1, "the pulse never touched the file"
    assert beat.read_text() == "{}"  # the pulse sets the time only


def test_status_during_a_long_warm_up_shows_a_live_heartbeat_and_the_time_so_far(tmp_path):
    """A warm-up compiles for minutes without reporting progress: `status` takes the heartbeat from the pulse (the
    file times a live rank keeps touching) and says what the phase does and for how long, instead of a heartbeat
    minutes old and an elapsed time stuck at the phase's start."""
    from dflash_train.run.directory import RunDir
    from dflash_train.run.status import StatusWriter, format_ranks, format_status, read_heartbeats, read_status
    from dflash_train.run.status import write_heartbeat

    run = RunDir(tmp_path / "R").create()
    writer = StatusWriter(run)  # this process is the run's: alive, by its pid and start time
    writer.update(phase="loading")
    writer.update(phase="warmup")
    write_heartbeat(run, 0, "warmup", 0)
    start, warm = writer.state["started_at"], writer.state.get("phase_since", writer.state["heartbeat"])
    now = warm + 200
    for path in (run.status, run.heartbeats / "rank-0.json"):
        os.utime(path, (now - 1, now - 1))  # the pulse, a second ago
    text = format_status(read_status(run.root)[0], None, now)
    assert "phase:      warmup (compiling and running the plan's batch shapes, 3m20s so far)\n" in text, text
    assert "heartbeat:  1s ago (pid" in text and f"elapsed:    {_mins(now - start)}\n" in text, text
    beats = read_heartbeats(run)
    ranks = format_ranks(beats, now)
    assert f"heartbeat 1.0 s ago (warmup for {_mins(now - beats[0]['time'])})" in ranks, ranks
    writer.update(phase="training", step=1)
    assert writer.state["phase_since"] > warm and "so far" not in format_status(read_status(run.root)[0], None, now)


@pytest.mark.long
def test_status_of_a_real_warm_up_shows_a_heartbeat_that_moves(smollm2_dir, counting_jsonl, tmp_path, capsys):
    """A real warm-up that compiles (the drafter through Dynamo on the CPU, on the real SmolLM2: about 10 s on 2
    cores): two pulses into it, with nothing written since it began, `status` shows a heartbeat of a second or two
    and the time the phase has lasted."""
    import re

    from _harness import cpu_drafter_compile_env
    from dflash_train.run.status import PULSE_S

    cfg = write_config(tmp_path / "c.yaml", smollm2_dir, counting_jsonl)
    run_dir = tmp_path / "R"
    proc = launch(["train", str(cfg), "--run-dir", str(run_dir), "--max-steps", "2", "drafter.compile=true"],
                  tmp_path / "r.log", env=cpu_drafter_compile_env(tmp_path / "site"))
    try:
        began = wait_until(lambda: _phase_began(run_dir, "warmup"), proc, 180, "the warm-up", interval=0.05)
        time.sleep(max(0.0, began + 2 * PULSE_S + 0.5 - time.time()))
        capsys.readouterr()
        assert main(["status", str(run_dir)]) == 0
        out = capsys.readouterr().out
    finally:
        if proc.poll() is None:
            proc.kill()
    if not out.startswith("phase:      warmup"):
        pytest.skip(f"the warm-up ended within {2 * PULSE_S:.0f} s on this machine: {out.splitlines()[0]}")
    assert re.search(r"warmup \(compiling and running the plan's batch shapes, \d+s so far\)", out), out
    assert int(re.search(r"heartbeat:  (\d+)s ago", out).group(1)) <= PULSE_S + 1, out


def _phase_began(run_dir: Path, phase: str) -> float:
    """When status.json says `phase` began (its last update), or 0 while it says another phase."""
    try:
        st = status(run_dir)
    except (OSError, ValueError):
        return 0
    return st["heartbeat"] if st.get("phase") == phase else 0


def _mins(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 60}m{s % 60:02d}s"


def test_status_into_a_pipe_whose_reader_left_ends_quietly(finished):
    """`dflash-train status RUN | head -1`: the reader closes the pipe before the status is written; the command
    ends without a traceback or an error line (exit 1: its output was not read)."""
    proc = subprocess.Popen([sys.executable, "-m", "dflash_train", "status", str(finished)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=ENV)
    proc.stdout.close()  # before the child has imported anything, so every write it makes meets a closed pipe
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 1
    assert "Broken pipe" not in err and "Traceback" not in err and "Exception ignored" not in err, err
