"""Split placement over gloo on CPU: target ranks stream hidden states to drafter ranks. The schedule
is checked exhaustively; real runs must log exactly the losses of the equivalent colocated run, stop
and resume exactly, and fail fast when a target rank dies."""

import copy
import itertools
import json
import os
import signal
import time

import pytest
import torch

from _harness import (assert_same_losses, beat, cpu_drafter_compile_env, cpu_target_compile_env, launch, losses, run,
                      status, stop, wait_for_step, wait_until, write_config)

from dflash_train.cli import main
from dflash_train.config.load import config_from_dict
from dflash_train.config.validate import validate_world
from dflash_train.errors import ConfigError
from dflash_train.train.split.transport import NOTE_BYTES, SplitLayout, decode_note, encode_note


# ---------------------------------------------------------------------------- the schedule


@pytest.mark.parametrize("world,targets,accum", [(2, 1, 1), (3, 2, 1), (3, 1, 2), (8, 5, 1), (8, 3, 2), (7, 3, 3)])
def test_every_micro_batch_has_one_producer_and_one_consumer(world, targets, accum):
    lay = SplitLayout(world, targets, accum)
    steps = 7
    groups = [[f"s{s}j{j}" for j in range(lay.per_step)] for s in range(steps)]
    consumed = {m: d for d in range(lay.drafter_ranks) for s in range(steps) for m in lay.consumed(d, s)}
    produced = {}
    for t in range(lay.drafter_ranks, world):
        ms = [m for m, _ in lay.produced(t, iter(groups), 0)]
        assert ms == sorted(ms), "a target must produce in schedule order"
        for m in ms:
            assert m not in produced
            produced[m] = t
    every = set(range(steps * lay.per_step))
    assert set(consumed) == every and set(produced) == every
    # each drafter rank gets grad_accum micro-batches per step; targets share the work evenly
    for d in range(lay.drafter_ranks):
        assert all(len(lay.consumed(d, s)) == accum for s in range(steps))
    counts = [sum(1 for t in produced.values() if t == r) for r in range(lay.drafter_ranks, world)]
    assert max(counts) - min(counts) <= 1
    # the rows a target sends are the rows of the micro-batch's slot in the shared plan
    for t in range(lay.drafter_ranks, world):
        for m, rows in lay.produced(t, iter(groups), 0):
            assert rows == f"s{m // lay.per_step}j{m % lay.per_step}"


@pytest.mark.parametrize("world,targets,accum", [(2, 1, 1), (3, 2, 1), (4, 1, 1), (8, 5, 1), (8, 3, 2), (5, 4, 3)])
def test_stop_reaches_every_target_exactly_once_at_the_ticket_it_waits_for(world, targets, accum):
    lay = SplitLayout(world, targets, accum)
    for asked_until in range(0, 6):
        sent = [(d, m) for d in range(lay.drafter_ranks) for m in lay.stop_tickets(d, asked_until)]
        by_target = {}
        for d, m in sent:
            assert lay.consumer(m) == d
            by_target.setdefault(lay.producer(m), []).append(m)
        assert sorted(by_target) == list(range(lay.drafter_ranks, world))
        for t, ms in by_target.items():
            # brute force: the first micro-batch of target t not yet asked for
            expect = next(m for m in itertools.count(asked_until * lay.per_step) if lay.producer(m) == t)
            assert ms == [expect]


def test_a_note_crosses_the_transport_whole_or_cut_at_a_character_boundary():
    for note in ("", "target_layer holds 61 variants: 0/3: tensor 'args[0]' size mismatch", "größe " * 600):
        slots, length = encode_note(note)
        assert slots.dtype == torch.int64 and len(slots) * 8 <= NOTE_BYTES and length <= NOTE_BYTES
        got = decode_note(slots, length)
        assert got == note if len(note.encode()) <= NOTE_BYTES else (note.startswith(got) and len(got) > 600)


@pytest.mark.parametrize("world,targets,accum", [(2, 1, 1), (3, 1, 1), (3, 2, 1), (5, 2, 3), (8, 5, 1)])
def test_captures_until_stop_bounds_what_a_target_computes_after_its_first_note(world, targets, accum):
    """The loop's rule replayed on the schedule: a note in a capture of step k reaches its drafter rank when it
    takes step k; the drafter ranks train through step k (one drafter rank) or k + 1 (several: their vote lands
    a step late), and the step after the last trained one was asked for already. From its first note a target
    computes each of its micro-batches asked for, then meets its STOP ticket: never more than the bound."""
    lay = SplitLayout(world, targets, accum)
    for t in range(lay.drafter_ranks, world):
        mine = [m for m in range(60 * lay.per_step) if lay.producer(m) == t]
        most = 0
        for first in mine[:20]:  # the first capture sent with a note
            last_trained = first // lay.per_step + (1 if lay.drafter_ranks > 1 else 0)
            asked_until = last_trained + 2
            computed = [m for m in mine if first <= m < asked_until * lay.per_step]
            stops = [m for d in range(lay.drafter_ranks) for m in lay.stop_tickets(d, asked_until)
                     if lay.producer(m) == t]
            assert stops == [mine[mine.index(computed[-1]) + 1]]  # its next micro-batch is its STOP
            most = max(most, len(computed))
        assert most <= lay.captures_until_stop()
        if lay.per_step % targets == 0:
            assert most == lay.captures_until_stop()  # and the bound is met: not looser than it must be


def test_invalid_split_fails_before_anything_loads(tmp_path, tiny_target_dir, counting_jsonl, capsys):
    with pytest.raises(ValueError, match="target_ranks=2 does not fit 2"):
        SplitLayout(2, 2)
    cfg = config_from_dict({"parallel": {"placement": "split"}, "run": {"eval_every": 0}})
    with pytest.raises(ConfigError, match="parallel.target_ranks.*do not fit 1 rank"):
        validate_world(cfg, 1)
    with pytest.raises(ConfigError, match="run.eval_every.*split"):
        config_from_dict({"parallel": {"placement": "split"}})
    path = write_config(tmp_path / "c.yaml", tiny_target_dir, counting_jsonl, run__eval_every=0)
    assert main(["train", str(path), "parallel.placement=split", "--run-dir", str(tmp_path / "r")]) == 2
    assert "parallel.target_ranks" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_gradient_accumulation_is_the_mean_over_micro_batches(tiny_target_dir):
    """Two accumulated micro-batches update the weights like one backward of their mean loss."""
    from dflash_train.architectures.family.backend import resolve_backend
    from dflash_train.architectures.dflash.model import DFlashDrafter
    from dflash_train.architectures.family.config import make_drafter_config
    from dflash_train.target.capture import TargetCapture, load_target_model
    from dflash_train.data.batch import Batch
    from dflash_train.architectures.dflash.objective import DFlashObjective
    from dflash_train.train.loop.step import MicroBatch, TrainStep

    cfg = config_from_dict({"drafter": {"block_size": 4, "num_draft_layers": 1}, "objective": {"max_anchors": 8},
                            "data": {"max_length": 64, "token_budget": 256}, "optim": {"grad_accum": 2}})
    model = load_target_model(tiny_target_dir, torch.float64, torch.device("cpu"))
    target = TargetCapture.from_model(model, [1, 3])
    torch.manual_seed(0)
    drafter = DFlashDrafter(make_drafter_config(model.config, num_draft_layers=1, block_size=4, target_layer_ids=[1, 3],
                                                mask_token_id=16)).double()
    reference = copy.deepcopy(drafter)
    backend = resolve_backend("sdpa", torch.device("cpu"), 4)
    g = torch.Generator().manual_seed(1)
    batches = [Batch(ids, torch.ones_like(ids), torch.tensor([ids.shape[1]] * 2))
               for ids in (torch.randint(3, 49152, (2, 40), generator=g), torch.randint(3, 49152, (2, 24), generator=g))]
    step = TrainStep(drafter, target, backend, cfg, 10, torch.float64, torch.device("cpu"))
    stats = step([MicroBatch(b) for b in batches], 3)

    # by hand: the same anchors (seeded by step, rank and micro-batch), mean loss, clip, AdamW
    ref_step = TrainStep(reference, target, backend, cfg, 10, torch.float64, torch.device("cpu"))
    parts = []
    for k, b in enumerate(batches):
        gen = torch.Generator().manual_seed(((cfg.run.seed * 1_000_003 + 3) * 1024 + 0) * 64 + k)
        parts.append(DFlashObjective(reference, target, backend, cfg, torch.float64)(b, gen).loss)
    loss = torch.stack(parts).mean()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(reference.parameters(), cfg.optim.grad_clip)
    ref_step.optimizer.step()
    assert float(stats.loss) == pytest.approx(float(loss), rel=1e-12)
    for (name, p), q in zip(drafter.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-12, msg=name)


# ---------------------------------------------------------------------------- real runs (gloo)

STEPS = 8


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_target_dir, counting_jsonl):
    root = tmp_path_factory.mktemp("split")
    cfg = write_config(root / "c.yaml", tiny_target_dir, counting_jsonl, run__eval_every=0)
    return root, cfg


def _train(root, cfg, name, nproc, *extra, steps=STEPS, env=None):
    out = root / name
    args = ["train", str(cfg), *extra, "--run-dir", str(out), "--max-steps", str(steps), "--nproc", str(nproc)]
    if nproc == 1 and env is None:  # one process: this one (a new one would spend seconds importing)
        assert main(args) == 0
        return out
    rc = run(args, root / f"{name}.log", timeout=300, env=env)
    assert rc == 0, (root / f"{name}.log").read_text()[-3000:]
    return out


@pytest.fixture(scope="module")
def single(setup):
    root, cfg = setup
    return _train(root, cfg, "single", 1)


@pytest.mark.long  # ~12 s: three ranks in real processes
@pytest.mark.slow
def test_two_targets_one_drafter_log_the_losses_of_one_process(setup, single):
    root, cfg = setup
    split = _train(root, cfg, "split-2+1", 3, "parallel.placement=split", "parallel.target_ranks=2")
    assert_same_losses(losses(single), losses(split), STEPS)
    st = status(split)
    assert st["phase"] == "done" and st["placement"] == "split 2+1"
    beats = {b: beat(split, b) for b in range(3)}
    assert all(b["phase"] == "done" for b in beats.values())
    assert sorted(b["step"] for b in beats.values()) == [STEPS - 1, STEPS, STEPS]  # target 1 made the even ones
    record = [json.loads(line) for line in (split / "metrics.jsonl").read_text().splitlines()][-1]
    assert record["transport_wait_s"] >= 0 and record["peak_mem_gib"] > 0
    assert (split / "export" / "model.safetensors").is_file()


@pytest.mark.slow
@pytest.mark.long
def test_one_target_two_compiled_drafters_log_the_losses_of_colocated_data_parallel(setup):
    """The production shape of run (split, several drafter ranks under DDP, `drafter.compile`), with the CPU
    standing in for the GPUs: hidden states from the transport reuse the warm-up's graphs on both drafter
    ranks, and the losses are those of the eager colocated run."""
    root, cfg = setup
    colocated = _train(root, cfg, "colocated-2", 2, steps=4)
    split = _train(root, cfg, "split-1+2", 3, "parallel.placement=split", "parallel.target_ranks=1",
                   "drafter.compile=true", steps=4, env=cpu_drafter_compile_env(root / "hook"))
    assert_same_losses(losses(colocated), losses(split), 4)
    assert status(split)["drafter_compiled_graphs"] > 0
    records = [json.loads(line) for line in (split / "metrics.jsonl").read_text().splitlines()]
    assert {r["recompiles"] for r in records if "recompiles" in r} == {0}
    for rank in range(3):  # the compile layer logs every recompile with its reason
        assert "recompiled" not in (split / f"rank-{rank}.out").read_text()


@pytest.mark.slow
@pytest.mark.parametrize("nproc,limit", [(2, 12), (3, 20)])
@pytest.mark.long
def test_a_target_rank_near_its_recompile_limit_stops_the_run_with_a_checkpoint_and_resume_finishes(setup, nproc,
                                                                                                   limit):
    """`target.compile` on the target rank with recompiles forced (its layers compiled with static shapes: every
    new batch shape a variant, a small limit): before any function could reach the limit the target rank's
    captures carry the news, the drafter ranks stop at a step boundary with a checkpoint and a RecompileLimitNear
    that names the target's function and guard, the target rank ends cleanly (nothing hangs); --resume (dynamic
    shapes again, a new process) finishes the run. Two drafter ranks (3 processes): their vote agrees a step late
    and each raises with the target's reason, whichever of them got the note."""
    root, cfg = setup
    out, log = root / f"target-limit-{nproc}", root / f"target-limit-{nproc}.log"
    target_rank = nproc - 1
    args = ["train", str(cfg), "parallel.placement=split", "target.compile=true", "--run-dir", str(out),
            "--max-steps", "24", "--nproc", str(nproc)]
    rc = run(args, log, timeout=240, env=cpu_target_compile_env(root / "static-target", limit=limit, static=True))
    st = status(out)
    assert rc == 1 and st["phase"] == "failed", (rc, st, log.read_text()[-3000:])
    error = st["error"]["secondary"]
    assert error.startswith(f"RecompileLimitNear: target rank {target_rank}: torch.compile: target_layer[eager]:"), \
        error
    assert "LlamaDecoderLayer holds" in error and f"recompile limit ({limit})" in error and "size mismatch" in error
    for rank in range(1, nproc - 1):  # the other drafter ranks raised with the same reason
        assert f"RecompileLimitNear: target rank {target_rank}: torch.compile" in (out / f"rank-{rank}.out").read_text()
    stopped_at = st["step"]
    assert 0 < stopped_at < 24 and st["checkpoint"].endswith(f"step-{stopped_at:08d}"), st
    assert (out / "checkpoints" / f"step-{stopped_at:08d}").is_dir()
    assert f"Stopped at step {stopped_at} with checkpoint" in error
    target_out = (out / f"rank-{target_rank}.out").read_text()
    assert "target rank finished" in target_out and "FailOnRecompileLimitHit" not in target_out
    counts = [line for line in target_out.splitlines() if "torch.compile recompiled after the warm-up (#" in line]
    assert counts and all("failed guard: " in line for line in counts)
    in_all = int(counts[-1].split(" in all)")[0].rsplit("#", 1)[1])
    assert in_all + 1 < limit  # the first compile and the recompiles: never at the limit
    target = beat(out, target_rank)
    assert target["phase"] == "done" and target["recompiles_after_warmup"] == len(counts), target
    assert target["recompile_limit_near"] in error and target["last_recompile"]

    rc = run(args + ["--resume"], log, timeout=240, env=cpu_target_compile_env(root / "dynamic-target"))
    st = status(out)
    assert rc == 0 and st["phase"] == "done" and st["step"] == 24, (rc, st, log.read_text()[-3000:])
    assert sorted(losses(out)) == list(range(1, 25))
    assert beat(out, target_rank)["recompiles_after_warmup"] == 0


@pytest.mark.slow
@pytest.mark.long
def test_sigterm_stops_the_split_with_a_checkpoint_and_resume_is_exact(setup, single, capsys):
    root, cfg = setup
    out, log = root / "term", root / "term.log"
    args = ["train", str(cfg), "parallel.placement=split", "--run-dir", str(out), "--max-steps", str(STEPS), "--nproc", "2"]
    proc = launch(args, log)
    try:
        wait_for_step(out, 0, 3, proc)
        wait_until(lambda: (b := beat(out, 1)) and b.get("produced"), proc, 30, "the target's first report")
        capsys.readouterr()
        assert main(["status", str(out)]) == 0  # live: both ranks, their roles, and which side limits the run
        live = capsys.readouterr().out
        assert "rank 0: drafter" in live and "rank 1: target" in live and "bound by:" in live, live
        pids = [beat(out, r)["pid"] for r in (0, 1)]
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=60)
    finally:
        stop(proc)
    st = status(out)
    assert rc == 3 and st["phase"] == "stopped", (rc, st, log.read_text()[-2000:])  # 3: stopped before done
    assert 3 <= st["step"] < STEPS and st["checkpoint"].endswith(f"step-{st['step']:08d}")
    for pid in pids:  # every process is gone
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert run(args + ["--resume"], log, timeout=300) == 0, log.read_text()[-3000:]
    assert_same_losses(losses(single), losses(out), STEPS)


@pytest.mark.slow
@pytest.mark.long  # ~35 s; by default a killed rank is test_distributed's (the same supervisor stops the run)
def test_a_killed_target_rank_fails_the_run_within_seconds_and_resume_is_exact(setup, single):
    root, cfg = setup
    out, log = root / "kill", root / "kill.log"
    args = ["train", str(cfg), "parallel.placement=split", "run.save_every=2", "--run-dir", str(out),
            "--max-steps", str(STEPS), "--nproc", "2"]
    proc = launch(args, log)
    try:
        wait_for_step(out, 0, 3, proc)
        target = wait_until(lambda: beat(out, 1), proc, 30, "the target's heartbeat")
        os.kill(target["pid"], signal.SIGKILL)
        t0 = time.time()
        rc = proc.wait(timeout=60)
        took = time.time() - t0
    finally:
        stop(proc)
    st = status(out)
    assert rc != 0 and took < 20, (rc, took)
    assert st["phase"] == "failed" and st["failed_rank"] == 1 and "rank 1 killed by signal 9" in st["error"]["message"]
    assert (out / "checkpoints" / "step-00000002").is_dir()
    assert run(args + ["--resume"], log, timeout=300) == 0, log.read_text()[-3000:]
    assert_same_losses(losses(single), losses(out), STEPS)


def test_preflight_counts_parameters_from_headers_and_budgets_by_role(tiny_target_dir):
    from dflash_train.target.capture import load_target_model
    from dflash_train.train.plan.preflight import MARGIN, check_gpu, checkpoint_parameters, needed_bytes

    model = load_target_model(tiny_target_dir, torch.float32, torch.device("cpu"))
    assert checkpoint_parameters(tiny_target_dir) == sum(p.numel() for p in model.parameters())
    assert needed_bytes(1000, torch.bfloat16, 10, "target") == MARGIN + 2000
    assert needed_bytes(1000, torch.bfloat16, 10, "drafter") == MARGIN + 160
    assert needed_bytes(1000, torch.float32, 10, "colocated") == MARGIN + 4160
    check_gpu(torch.device("cpu"), 2**60, 0, "anything")  # CPU runs have no device memory to check


def test_status_names_the_side_that_limits_a_split_run():
    from dflash_train.run.status import bound_side, format_ranks

    now = 1000.0
    drafter = {"rank": 0, "role": "drafter", "phase": "training", "step": 9, "time": now - 1, "train_s": 100.0,
               "transport_wait_s": 30.0, "mem_gib": 40.0}
    target = {"rank": 1, "role": "target", "phase": "training", "step": 10, "time": now - 2, "busy_s": 95.0,
              "wait_s": 5.0, "produced": 20, "mem_gib": 20.0}
    assert bound_side([drafter, target]).startswith("the target side: drafter ranks wait 30%")
    idle = dict(target, busy_s=40.0, wait_s=60.0)
    calm = dict(drafter, transport_wait_s=0.5)
    assert bound_side([calm, idle]) == "the drafter side: target ranks idle 60% of the time (move a GPU to the drafter side)"
    assert bound_side([dict(drafter, role="colocated")]) is None
    text = format_ranks([calm, idle], now)
    assert "rank 0: drafter" in text and "waited 0.5 s for hidden states" in text and "idle 60.0 s, busy 40.0 s" in text
    assert text.endswith("(move a GPU to the drafter side)")
