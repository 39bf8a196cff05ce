"""`target.sharding: fsdp` on CPU over gloo (real processes, real torch.distributed): each rank reads only its
rows of the checkpoint, the shards assemble to transformers' own load bit for bit, and the sharded capture equals
the unsharded one bit for bit (the all-gathered weights are the same numbers and each rank runs the same
kernels on the same shapes). Dense and MoE targets, 2 and 4 ranks, one shard group and two."""

import json

import pytest
import torch
import torch.multiprocessing as mp

from _shard_worker import in_turn
from _moe_targets import qwen3_5_moe, qwen3_moe, save

from dflash_train.target.shard import rows_of


def dense():
    """A tied Qwen3 whose MLP width (90) splits unevenly over 4 ranks."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return Qwen3ForCausalLM(Qwen3Config(hidden_size=64, intermediate_size=90, num_hidden_layers=4,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=1000,
                                        tie_word_embeddings=True))


def moe_six_experts():
    """6 experts over 4 ranks: shards of 2, 2, 2 and none."""
    return qwen3_moe(num_experts=6)


def _case(tmp_path, build, world, group, compile=False):
    """(the rank function's name, its arguments) for `build`'s target, and the folder its ranks write to."""
    target = save(build, tmp_path / "target")
    out = tmp_path / "out"
    out.mkdir()
    return ("sharded_capture_rank", (world, str(out / "init"), str(target), group, [0, 1, 2], str(out), compile)), out


def _results(out, world):
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


def _run(tmp_path, build, world, group, compile=False):
    case, out = _case(tmp_path, build, world, group, compile)
    mp.spawn(in_turn, args=([case],), nprocs=world, join=True)
    return _results(out, world)


TWO_RANKS = {"dense-2": dense, "moe-2": qwen3_moe}


@pytest.fixture(scope="module")
def two_rank_results(tmp_path_factory):
    """The two-rank cases of the default run, in one pair of processes: {id: each rank's results}."""
    cases, outs = [], {}
    for name, build in TWO_RANKS.items():
        case, outs[name] = _case(tmp_path_factory.mktemp(name), build, 2, 2)
        cases.append(case)
    mp.spawn(in_turn, args=(cases,), nprocs=2, join=True)
    return {name: _results(out, 2) for name, out in outs.items()}


def test_rows_split_like_torch_chunk():
    for total in (1, 5, 6, 90, 64):
        for parts in (1, 2, 3, 4):
            want = [c.shape[0] for c in torch.arange(total).chunk(parts)]
            want += [0] * (parts - len(want))
            got = [rows_of(total, parts, i) for i in range(parts)]
            assert [e - s for s, e in got] == want
            assert got[0][0] == 0 and all(got[i][1] == got[i + 1][0] for i in range(parts - 1))


@pytest.mark.parametrize("build, world, group", [
    (dense, 2, 2), (qwen3_moe, 2, 2),
    pytest.param(dense, 4, 4, marks=pytest.mark.long), pytest.param(moe_six_experts, 4, 4, marks=pytest.mark.long),
    pytest.param(qwen3_5_moe, 4, 2, marks=pytest.mark.long),
], ids=["dense-2", "moe-2", "dense-4", "moe-4-empty-shard", "qwen3.5-moe-4-two-groups"])
def test_sharded_target_loads_its_rows_and_captures_exactly(request, tmp_path, build, world, group):
    case = request.node.callspec.id
    results = (request.getfixturevalue("two_rank_results")[case] if case in TWO_RANKS
               else _run(tmp_path, build, world, group))
    for r, got in enumerate(results):
        assert got["mismatched"] == [], (r, got["mismatched"])
        assert got["sharded_params"] > 0
        assert got["equal"], (r, got["max_diff"])
        flags = ("equal_with_final", "equal_again", "lm_head_equal")
        assert all(got[k] for k in flags), (r, {k: got[k] for k in flags})
        assert got["hf_hidden_states_equal"]
        assert got["tied"] == (build is dense)


@pytest.mark.long
def test_compiled_sharded_capture_equals_the_eager_whole_one(tmp_path):
    """`target.compile` on a sharded target: the layers' compiled forward runs between FSDP's hooks (the gathered
    weights are its inputs), one graph per batch kind, none after the warm-up, the capture unchanged."""
    for got in _run(tmp_path, dense, 2, 2, compile=True):
        assert got["equal"] and got["equal_with_final"] and got["equal_again"], got
        assert got["target_compiled_graphs"] == 2 and got["target_recompiled_after_warmup"] == 0, got


def _big_dense():
    """~300 MB of float32 decoder layers and a small vocabulary: the layers are nearly all of it."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return Qwen3ForCausalLM(Qwen3Config(hidden_size=1024, intermediate_size=2816, num_hidden_layers=6,
                                        num_attention_heads=8, num_key_value_heads=8, head_dim=128, vocab_size=1000))


@pytest.mark.long
@pytest.mark.parametrize("sharding", ["fsdp", "tp"])
def test_each_rank_reads_only_its_share_of_a_target_larger_than_it(tmp_path, monkeypatch, sharding):
    """Two ranks load a target twice as large as each one's share: each one's peak host memory grows by about
    its share (far less than the whole model, which a full copy per rank would add; tp's row-parallel columns
    pass through one bounded block of rows at a time); fsdp's first forward then adds the gathered buffers of a
    few layers, not more. glibc is told to give large blocks back when they are freed, so the peaks are the
    program's, not the allocator's keeping."""
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", str(2**20))
    from dflash_train.train.plan.preflight import checkpoint_parameters

    torch.manual_seed(0)
    target = tmp_path / "target"
    _big_dense().save_pretrained(target)
    model_gib = checkpoint_parameters(target) * 4 / 2**30
    out = tmp_path / "out"
    out.mkdir()
    from _shard_worker import sharded_load_memory_rank

    mp.spawn(sharded_load_memory_rank, args=(2, str(out / "init"), str(target), str(out), sharding), nprocs=2,
             join=True)
    for r in range(2):
        got = json.loads((out / f"rank{r}.json").read_text())
        assert 0.45 * model_gib < got["resident_gib"] < 0.55 * model_gib, got
        assert got["load_peak_gib"] < got["resident_gib"] + 0.1 * model_gib, (got, model_gib)
        # Measured 4.1 layers on gloo: two layers gathered at once (the prefetch), the all-gather's staging copies.
        assert got["forward_peak_gib"] < 5 * got["layer_gib"], got


@pytest.mark.parametrize("build", [dense, qwen3_5_moe], ids=["dense", "qwen3.5-moe (multimodal checkpoint)"])
def test_preflight_counts_a_rank_s_shard_the_whole_rest_and_the_gathered_layers(tmp_path, build):
    """From the checkpoint's headers: the decoder layers (a vision tower's blocks are not among them), the
    largest one, and a rank's need: its 1/parts of the layers, everything else whole, 3 gathered layers."""
    from dflash_train.train.plan.preflight import TargetShare, checkpoint_parameters, needed_bytes

    torch.manual_seed(0)
    model = build()
    path = save(build, tmp_path)
    decoder = model.model.language_model if hasattr(model.model, "language_model") else model.model
    per_layer = [sum(p.numel() for p in layer.parameters()) for layer in decoder.layers]
    total = checkpoint_parameters(path)
    share = TargetShare.of(path, 4)
    assert (share.layer_params, share.largest_layer) == (sum(per_layer), max(per_layer))
    assert share.parameters(total) == total - sum(per_layer) + -(-sum(per_layer) // 4) + 3 * max(per_layer)
    assert needed_bytes(total, torch.bfloat16, 10, "colocated", share) == (
        needed_bytes(0, torch.bfloat16, 10, "colocated") + 2 * share.parameters(total))
