"""Training against a sharded target (`target.sharding: fsdp` or `tp`), on CPU over gloo in real processes: with
fsdp the losses equal the unsharded run's bit for bit (the captures are bit-identical, so the steps are too), dense
and MoE, one rank and two; with tp (dense targets) they equal them to float32 rounding (the all-reduce sums in
another order) and a resumed tp run those of the uninterrupted one exactly; plus the config's refusals, before
anything loads."""

import shutil

import pytest
import torch

from _harness import assert_same_losses, beat, kill_rank_and_time, losses, run, status, write_config
from conftest import TOKENIZER_FILES
from _moe_targets import qwen3_moe

from dflash_train.cli import main
from dflash_train.config.load import config_from_dict
from dflash_train.config.validate import validate_world
from dflash_train.errors import ConfigError

STEPS = 6
# Tensor parallelism sums each row-parallel matmul's partial products over the ranks (the all-reduce), in another
# order than one matmul does; training amplifies that float32 rounding step by step (1.1e-6 relative by step 6 on
# one CPU, under 1e-6 on another). fsdp gathers whole weights: its losses are compared bit for bit besides.
TP_REL = 1e-5


def rel_for(sharding: str) -> float:
    return TP_REL if sharding == "tp" else 1e-6


@pytest.fixture(scope="module")
def moe_target_dir(tmp_path_factory, tokenizer_dir):
    """A tiny Qwen3-MoE with SmolLM2's tokenizer (its vocabulary size) and random routers."""
    out = tmp_path_factory.mktemp("moe-target")
    torch.manual_seed(0)
    model = qwen3_moe(vocab_size=49152, bos_token_id=1, eos_token_id=2, pad_token_id=2).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0, 0.5)
    model.save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, out / name)
    return out


def _args(tmp_path, target, data, name, nproc, *extra, steps=STEPS):
    cfg = write_config(tmp_path / f"{name}.yaml", target, data, run__eval_every=0)
    return ["train", str(cfg), *extra, "--run-dir", str(tmp_path / name), "--max-steps", str(steps), "--nproc",
            str(nproc)]


def _train(tmp_path, target, data, name, nproc, *extra, steps=STEPS, resume=False):
    rc = run(_args(tmp_path, target, data, name, nproc, *extra, steps=steps) + ["--resume"] * resume,
             tmp_path / f"{name}.log", timeout=300)
    assert rc == 0, (tmp_path / f"{name}.log").read_text()[-3000:]
    return tmp_path / name


@pytest.mark.parametrize("sharding", ["fsdp", "tp"])
def test_one_rank_sharded_trains_the_losses_of_none(tmp_path, tiny_target_dir, counting_jsonl, sharding):
    """World size 1: a shard group of one (its own process group on an in-memory store) is the plain run."""
    base = write_config(tmp_path / "c.yaml", tiny_target_dir, counting_jsonl, run__eval_every=0)
    plain, sharded = tmp_path / "none", tmp_path / sharding
    assert main(["train", str(base), "--run-dir", str(plain), "--max-steps", str(STEPS)]) == 0
    assert main(["train", str(base), f"target.sharding={sharding}", "--run-dir", str(sharded), "--max-steps",
                 str(STEPS)]) == 0
    assert_same_losses(losses(plain), losses(sharded), STEPS)
    assert losses(plain) == losses(sharded)  # bit-identical captures: bit-identical steps
    st = status(sharded)
    assert st["phase"] == "done" and st["target_sharding"] == sharding and st["target_shard_ranks"] == 1
    assert st["host_peak_gib"] > 0


@pytest.mark.parametrize("sharding", ["fsdp", "tp"])
def test_a_run_resumes_sharded_with_the_losses_it_would_have_had(tmp_path, tiny_target_dir, counting_jsonl, sharding):
    """`target.sharding` may change on --resume (the captures are the same numbers): a run stopped at step 3
    continues sharded and logs the uninterrupted unsharded run's losses."""
    base = write_config(tmp_path / "c.yaml", tiny_target_dir, counting_jsonl, run__eval_every=0, run__save_every=3)
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    assert main(["train", str(base), "--run-dir", str(whole), "--max-steps", str(STEPS)]) == 0
    shutil.copytree(whole, resumed)  # the run as a kill at step 4 leaves it: no later checkpoint, export, status
    for later in [p for p in (resumed / "checkpoints").iterdir() if p.name != "step-00000003"] + [resumed / "export"]:
        shutil.rmtree(later)
    (resumed / "status.json").unlink()
    assert main(["train", "--resume", "--run-dir", str(resumed), f"target.sharding={sharding}"]) == 0
    assert losses(whole) == losses(resumed)
    assert status(resumed)["target_sharding"] == sharding
    assert "target.sharding" in (resumed / "resumes.jsonl").read_text()


@pytest.mark.long
@pytest.mark.parametrize("target, sharding", [("dense", "fsdp"), ("moe", "fsdp"), ("dense", "tp")])
def test_two_ranks_sharded_train_the_losses_of_unsharded(tmp_path, request, counting_jsonl, target, sharding):
    """tp: each rank's own micro-batch goes through the tensor-parallel layers in turn with its peer's (the two
    ranks' batches differ); its losses are the unsharded run's to float32 rounding."""
    target_dir = request.getfixturevalue("tiny_target_dir" if target == "dense" else "moe_target_dir")
    plain = _train(tmp_path, target_dir, counting_jsonl, "none", 2)
    sharded = _train(tmp_path, target_dir, counting_jsonl, sharding, 2, f"target.sharding={sharding}")
    assert_same_losses(losses(plain), losses(sharded), STEPS, rel_for(sharding))
    if sharding == "fsdp":
        assert losses(plain) == losses(sharded)  # bit-identical captures: bit-identical steps
    else:
        assert losses(plain) != losses(sharded)  # the all-reduce's order shows: tp really ran split
    assert status(sharded)["target_shard_ranks"] == 2
    assert all(beat(sharded, r)["host_peak_gib"] > 0 for r in range(2))


@pytest.mark.long
def test_four_ranks_in_two_shard_groups_train_the_losses_of_unsharded(tmp_path, moe_target_dir, counting_jsonl):
    plain = _train(tmp_path, moe_target_dir, counting_jsonl, "none", 4)
    sharded = _train(tmp_path, moe_target_dir, counting_jsonl, "hsdp", 4, "target.sharding=fsdp",
                     "target.shard_group_size=2")
    assert_same_losses(losses(plain), losses(sharded), STEPS)
    assert losses(plain) == losses(sharded)  # bit-identical captures: bit-identical steps
    assert status(sharded)["target_shard_ranks"] == 2


@pytest.mark.parametrize("over, message", [
    ({"target": {"sharding": "zero3"}}, r"'target.sharding': must be one of none, fsdp, tp \(got 'zero3'\)"),
    ({"target": {"shard_group_size": 2}}, r"'target.shard_group_size': applies to a sharded target only"),
    ({"target": {"sharding": "fsdp", "shard_group_size": 0}},
     r"'target.shard_group_size': must be a positive integer or null, got 0"),
    ({"target": {"sharding": "fsdp", "quantize": "fp8"}}, r"'target.quantize': an FP8 target cannot be sharded yet"),
    ({"target": {"sharding": "tp", "quantize": "fp8"}},
     r"'target.quantize': an FP8 target cannot be sharded yet \(target.sharding=tp\)"),
    ({"target": {"sharding": "tp", "shard_group_size": 0}},
     r"'target.shard_group_size': must be a positive integer or null, got 0"),
    ({"target": {"sharding": "tp", "compile": True}, "run": {"device": "cuda"}},
     r"'target.compile': a tensor-parallel target's compiled layers would recompile"),
])
def test_bad_sharding_configs_are_refused_at_load(over, message):
    with pytest.raises(ConfigError, match=message):
        config_from_dict(over)


def _as_dict(cfg):
    from dflash_train.config.load import config_to_dict

    return config_to_dict(cfg)


def test_defaults_and_group_size_must_divide_the_ranks():
    cfg = config_from_dict({})
    assert cfg.target.sharding == "none" and cfg.target.shard_group_size is None
    cfg = config_from_dict({"target": {"sharding": "fsdp", "shard_group_size": 2}, "run": {"eval_every": 0}})
    validate_world(cfg, 4)
    with pytest.raises(ConfigError, match=r"'target.shard_group_size': 2 does not divide the run's 3 rank\(s\)"):
        validate_world(cfg, 3)
    with pytest.raises(ConfigError, match=r"'target.shard_group_size': 2 does not divide the run's 1 rank\(s\)"):
        validate_world(cfg, 1)
    split = config_from_dict({"target": {"sharding": "fsdp"}, "run": {"eval_every": 0},
                              "parallel": {"placement": "split", "target_ranks": 2}})
    validate_world(split, 4)  # 2 drafter ranks: one micro-batch per target rank and step
    with pytest.raises(ConfigError, match=r"'parallel.target_ranks': .* each step's 1 micro-batches .* over the 2 "
                                          r"target ranks"):
        validate_world(split, 3)
    with pytest.raises(ConfigError, match=r"'target.shard_group_size': 4 does not divide the 2 target rank\(s\)"):
        validate_world(config_from_dict({**_as_dict(split), "target": {"sharding": "fsdp", "shard_group_size": 4}}), 4)


@pytest.mark.long
@pytest.mark.parametrize("target, sharding", [("moe", "fsdp"), ("dense", "tp")])
def test_a_killed_rank_stops_a_sharded_run_fast_and_resume_is_exact(tmp_path, request, counting_jsonl, target,
                                                                     sharding):
    """Rank 1 of a sharded run killed mid-run (rank 0 then waits in an all-gather or all-reduce that never
    completes): the run fails within seconds naming it; --resume continues from the step-4 checkpoint with the
    losses of the uninterrupted run (fsdp: the unsharded one; tp: the uninterrupted tp run, bit for bit)."""
    steps = 10
    target_dir = request.getfixturevalue("tiny_target_dir" if target == "dense" else "moe_target_dir")
    sharded = f"target.sharding={sharding}"
    plain = _train(tmp_path, target_dir, counting_jsonl, "uninterrupted", 2, *([sharded] * (sharding == "tp")),
                   steps=steps)
    args = _args(tmp_path, target_dir, counting_jsonl, "killed", 2, sharded, steps=steps)
    run_dir = tmp_path / "killed"
    rc, took, st = kill_rank_and_time(run_dir, args, tmp_path / "killed.log", wait_rank=1, kill_rank=1)
    assert rc != 0 and took < 15 and st["phase"] == "failed" and st["failed_rank"] == 1, (rc, took, st)
    _train(tmp_path, target_dir, counting_jsonl, "killed", 2, sharded, steps=steps, resume=True)
    assert losses(plain) == losses(run_dir)


@pytest.mark.long
@pytest.mark.parametrize("target, sharding", [("moe", "fsdp"), ("dense", "tp")])
def test_split_target_ranks_in_a_shard_group_train_the_losses_of_colocated(tmp_path, request, counting_jsonl, target,
                                                                           sharding):
    """Split 2 + 2: the two target ranks hold one sharded copy of the target between them and each captures
    its own micro-batches through the deterministic schedule (in lockstep: fsdp all-gathers each layer together,
    tp runs both ranks' batches in turn); the drafter ranks train the losses of two colocated ranks with the whole
    target (tp: to float32 rounding)."""
    target_dir = request.getfixturevalue("tiny_target_dir" if target == "dense" else "moe_target_dir")
    plain = _train(tmp_path, target_dir, counting_jsonl, "colocated", 2)
    split = _train(tmp_path, target_dir, counting_jsonl, "split", 4, f"target.sharding={sharding}",
                   "parallel.placement=split", "parallel.target_ranks=2")
    assert_same_losses(losses(plain), losses(split), STEPS, rel_for(sharding))
    if sharding == "fsdp":
        assert losses(plain) == losses(split)
    assert status(split)["placement"] == "split 2+2"
    assert all(beat(split, r)["host_peak_gib"] > 0 for r in (2, 3))


@pytest.mark.long
@pytest.mark.parametrize("target, sharding", [("moe", "fsdp"), ("dense", "tp")])
def test_every_rank_validates_with_a_sharded_target_and_rank_0_records_the_unsharded_numbers(
        tmp_path, request, counting_jsonl, target, sharding):
    """Validation during training with a sharded colocated target: every rank runs the same validation (each
    capture and each decoding step needs the whole shard group), rank 0 alone records it; the validation
    records and the losses are those of the unsharded run, whose rank 0 validates alone (tp: to float32
    rounding; the accepted tokens the same)."""
    from dflash_train.run.metrics import read_metrics

    target_dir = request.getfixturevalue("tiny_target_dir" if target == "dense" else "moe_target_dir")

    def train(name, *extra):
        cfg = write_config(tmp_path / f"{name}.yaml", target_dir, counting_jsonl, run__eval_every=3,
                           data__val_files=[str(counting_jsonl)], run__eval_batches=2, run__eval_prompts=1,
                           run__eval_max_new_tokens=16)
        out = tmp_path / name
        rc = run(["train", str(cfg), *extra, "--run-dir", str(out), "--max-steps", str(STEPS), "--nproc", "2"],
                 tmp_path / f"{name}.log", timeout=300)
        assert rc == 0, (tmp_path / f"{name}.log").read_text()[-3000:]
        return out

    plain, sharded = train("none"), train(sharding, f"target.sharding={sharding}")
    assert_same_losses(losses(plain), losses(sharded), STEPS, rel_for(sharding))
    if sharding == "fsdp":
        assert losses(plain) == losses(sharded)

    def validations(out):
        return [{k: v for k, v in r.items() if k != "val_seconds"} for r in read_metrics(out)
                if r.get("kind") == "validation"]

    want = validations(plain)
    assert [r["step"] for r in want] == [3, 6] and all("val_tau" in r and "val_tau_walk" in r for r in want)
    got = validations(sharded)
    if sharding == "fsdp":
        assert got == want
    else:
        assert [sorted(r) for r in got] == [sorted(r) for r in want]
        for g, w in zip(got, want):
            assert g == {k: pytest.approx(v, rel=1e-5, abs=1e-6) if isinstance(v, float) else v
                         for k, v in w.items()}, (g, w)
    assert (sharded / "checkpoints" / "best").is_dir()


@pytest.mark.long
def test_a_killed_target_rank_of_a_sharded_split_fails_fast_and_resume_is_exact(tmp_path, moe_target_dir,
                                                                                 counting_jsonl):
    """Split 2 + 2 with the two target ranks sharing the sharded target: one target rank killed mid-run (its
    peer then waits in an all-gather, the drafter ranks for captures) fails the run within seconds naming it;
    --resume replays the schedule from the checkpoint and gives the colocated losses exactly."""
    steps = 10
    plain = _train(tmp_path, moe_target_dir, counting_jsonl, "colocated", 2, steps=steps)
    extra = ("target.sharding=fsdp", "parallel.placement=split", "parallel.target_ranks=2")
    run_dir = tmp_path / "killed"
    rc, took, st = kill_rank_and_time(run_dir, _args(tmp_path, moe_target_dir, counting_jsonl, "killed", 4, *extra,
                                                     steps=steps), tmp_path / "killed.log", wait_rank=0, kill_rank=3)
    assert rc != 0 and took < 15 and st["phase"] == "failed" and st["failed_rank"] == 3, (rc, took, st)
    _train(tmp_path, moe_target_dir, counting_jsonl, "killed", 4, *extra, steps=steps, resume=True)
    assert losses(plain) == losses(run_dir)


def test_tp_of_a_moe_target_is_refused_before_anything_loads(tmp_path, moe_target_dir, counting_jsonl, capsys):
    """From the target's config.json, at admission: the run directory is not even created."""
    args = _args(tmp_path, moe_target_dir, counting_jsonl, "refused", 1, "target.sharding=tp")
    assert main(args) != 0
    assert "mixture of experts (num_experts=8), which tp does not split yet; use target.sharding=fsdp" in \
        capsys.readouterr().err
    assert not (tmp_path / "refused").exists()
