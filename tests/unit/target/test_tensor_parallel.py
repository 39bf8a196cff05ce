"""`target.sharding: tp` on CPU over gloo (real processes, real torch.distributed): each rank reads only its rows
(column-parallel) and columns (row-parallel) of the checkpoint, equal to slices of transformers' own load; the
capture, a full forward and a KV-cache forward equal the whole target's to float32 rounding (the all-reduce sums
the ranks' partial products in another order); and what tp cannot split is refused before any weights load."""

import json

import pytest
import torch
import torch.multiprocessing as mp

from _shard_worker import tp_capture_rank
from _moe_targets import qwen3_5_moe, qwen3_moe, save

from dflash_train.errors import ConfigError
from dflash_train.target import shard
from dflash_train.target.tensor_parallel import check_tp_target

# float32 sums of a few dozen products in another order: a few ulp of the largest value.
TOLERANCE = 1e-5


def qwen3_tied():
    """A tied Qwen3 (q/k norms per head) with 8 query and 4 key-value heads: splits over 2 and 4 ranks."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return Qwen3ForCausalLM(Qwen3Config(hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                                        num_attention_heads=8, num_key_value_heads=4, head_dim=16, vocab_size=1000,
                                        tie_word_embeddings=True))


def qwen2_biased():
    """An untied Qwen2: q/k/v biases (column-parallel biases split with their rows)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return Qwen2ForCausalLM(Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=1000,
                                        tie_word_embeddings=False))


def qwen3_mlp_90():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return Qwen3ForCausalLM(Qwen3Config(hidden_size=64, intermediate_size=90, num_hidden_layers=1,
                                        num_attention_heads=4, num_key_value_heads=4, head_dim=16, vocab_size=100))


def _run(tmp_path, build, world, group, layer_ids=(0, 1, 2)):
    target = save(build, tmp_path / "target")
    out = tmp_path / "out"
    out.mkdir()
    mp.spawn(tp_capture_rank, args=(world, str(out / "init"), str(target), group, list(layer_ids), str(out)),
             nprocs=world, join=True)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


@pytest.mark.parametrize("build, world, group", [
    (qwen3_tied, 2, 2),
    pytest.param(qwen2_biased, 2, 2, marks=pytest.mark.long),
    pytest.param(qwen3_tied, 4, 4, marks=pytest.mark.long),
    pytest.param(qwen3_tied, 4, 2, marks=pytest.mark.long),
], ids=["qwen3-tied-2", "qwen2-bias-2", "qwen3-4", "qwen3-4-two-groups"])
def test_tp_target_reads_its_slices_and_captures_the_whole_target_s_states(tmp_path, build, world, group):
    for r, got in enumerate(_run(tmp_path, build, world, group)):
        assert got["mismatched"] == [], (r, got["mismatched"])
        column, row = 0, 1
        want_dims = {"self_attn.q_proj.weight": column, "self_attn.k_proj.weight": column,
                     "self_attn.v_proj.weight": column, "self_attn.o_proj.weight": row,
                     "mlp.gate_proj.weight": column, "mlp.up_proj.weight": column, "mlp.down_proj.weight": row}
        if build is qwen2_biased:
            want_dims.update({f"self_attn.{p}_proj.bias": column for p in "qkv"})
        assert got["split_dims"] == want_dims, (r, got["split_dims"])
        assert got["plain_tensor"]
        for key in ("capture_diff", "final_diff", "again_diff", "hf_hidden_states_diff", "cached_logits_diff"):
            assert got[key] < TOLERANCE, (r, key, got[key])
        assert got["hf_layers"][0] == got["hf_layers"][1]
        assert got["lm_head_equal"] and got["tied"] == (build is qwen3_tied)


def test_a_column_slice_is_read_in_blocks_of_whole_rows(tmp_path, monkeypatch):
    """Blocks smaller than the tensor (and a short last one): the columns equal the tensor's slice."""
    from safetensors.torch import save_file

    t = torch.randn(37, 24, dtype=torch.float32).to(torch.bfloat16)
    save_file({"w": t, "before": torch.zeros(3)}, tmp_path / "m.safetensors")
    monkeypatch.setattr(shard, "_COLUMN_BLOCK_BYTES", 5 * 24 * 2)  # 5 rows a block: 8 blocks, the last of 2 rows
    f = shard._SafetensorsFile(tmp_path / "m.safetensors")
    try:
        for start, end in ((0, 12), (12, 24), (5, 6), (0, 24)):
            assert torch.equal(f.columns("w", start, end), t[:, start:end]), (start, end)
    finally:
        f.close()


def _text_config(build):
    model = build()
    return model.config.get_text_config(decoder=True)


@pytest.mark.parametrize("build, parts, message", [
    (qwen3_tied, 3, r"'target.shard_group_size': tp over 3 ranks .* num_attention_heads=8, num_key_value_heads=4 "
                    r"do not divide by 3; give a shard group size that divides"),
    (qwen3_mlp_90, 4, r"tp over 4 ranks .* the target's intermediate_size=90 does not divide by 4"),
    (qwen3_tied, 8, r"'target.shard_group_size': tp over 8 ranks .* num_key_value_heads=4 does not divide by 8"),
    (qwen3_moe, 2, r"'target.sharding': .* mixture of experts \(num_experts=8\).* use target.sharding=fsdp"),
    (qwen3_5_moe, 2, r"'target.sharding': .* mixture of experts .* use target.sharding=fsdp"),
], ids=["heads-over-3", "mlp-width-over-4", "kv-heads-over-8", "qwen3-moe", "qwen3.5-moe"])
def test_what_tp_cannot_split_is_refused_from_the_config(build, parts, message):
    with pytest.raises(ConfigError, match=message):
        check_tp_target(_text_config(build), parts)


def test_layers_of_another_kind_are_refused_from_the_config():
    from transformers.models.qwen3_5 import Qwen3_5TextConfig

    hybrid = Qwen3_5TextConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, head_dim=16, vocab_size=1000,
                               layer_types=["linear_attention", "full_attention"])
    with pytest.raises(ConfigError, match=r"'target.sharding': .* layers of kind linear_attention"):
        check_tp_target(hybrid, 2)
    check_tp_target(_text_config(qwen3_tied), 4)  # what divides passes


def test_only_a_tensor_parallel_decoder_exchanges_its_members_batches():
    """An FSDP2 decoder (its layers DTensors sharded on dim 0) must capture each rank's own batch alone: only
    row-parallel weights mark a tensor-parallel one. One rank, a process group of its own."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module

    from dflash_train.target.shard import shard_mesh
    from dflash_train.target.tensor_parallel import shard_group_of

    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        mesh = shard_mesh(torch.device("cpu"), [0], 1)
        fsdp, tp, plain = (qwen3_tied().model for _ in range(3))
        for layer in fsdp.layers:
            fully_shard(layer, mesh=mesh)
        for layer in tp.layers:
            parallelize_module(layer, mesh["shard"], {"mlp.down_proj": RowwiseParallel()})
        assert shard_group_of(fsdp) is None and shard_group_of(plain) is None
        assert shard_group_of(tp) is not None
    finally:
        dist.destroy_process_group()
