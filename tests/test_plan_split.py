"""The split planner's arithmetic: the pipeline runs at its slower side."""

import importlib.util
import json
import sys
from pathlib import Path

spec = importlib.util.spec_from_file_location("plan_split", Path(__file__).parent.parent / "benchmarks" / "plan_split.py")
plan = importlib.util.module_from_spec(spec)
sys.modules["plan_split"] = plan  # its dataclass looks its module up
spec.loader.exec_module(plan)


def test_prediction_is_bound_by_the_slower_side():
    assert plan.predict(10_000, 2_000, 2, 6) == 12_000
    assert plan.predict(10_000, 2_000, 1, 7) == 10_000


def test_best_split_is_the_argmax_over_all_splits():
    t, d, p = plan.best_split(8_000, 2_000, 8)
    assert (t, d) == (2, 6) and p == 12_000
    brute = max(min(t * 8_000, (8 - t) * 2_000) for t in range(1, 8))
    assert p == brute


def test_rates_read_from_benchmark_json(tmp_path):
    f = tmp_path / "b.jsonl"
    f.write_text(json.dumps({"shape": "s", "part": "target", "tokens_per_s": 5}) + "\n"
                 + json.dumps({"shape": "s", "part": "drafter", "tokens_per_s": 3}) + "\n")
    assert plan.rates_from_json(str(f), "s") == (5, 3)


def _decoder_layer_matmul_params(config) -> int:
    """Linear weights of one real transformers decoder layer (meta device: nothing allocated)."""
    import torch
    from transformers import AutoModelForCausalLM

    config.num_hidden_layers = 1
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    layer = model.model.layers[0]
    return sum(p.numel() for name, p in layer.named_parameters() if "norm" not in name)


def test_layer_params_equal_the_real_models_dense_and_moe():
    from transformers import LlamaConfig, Qwen3Config, Qwen3MoeConfig

    c = plan.PLAN_SHAPES["llama3-70b-class"]
    llama = LlamaConfig(hidden_size=c["hidden_size"], intermediate_size=c["intermediate_size"],
                        num_attention_heads=c["num_attention_heads"], num_key_value_heads=c["num_key_value_heads"],
                        head_dim=c["head_dim"], vocab_size=c["vocab_size"], num_hidden_layers=1)
    assert plan.layer_params(c) == _decoder_layer_matmul_params(llama)
    c = plan.PLAN_SHAPES["qwen3-32b"]
    qwen = Qwen3Config(hidden_size=c["hidden_size"], intermediate_size=c["intermediate_size"],
                       num_attention_heads=c["num_attention_heads"], num_key_value_heads=c["num_key_value_heads"],
                       head_dim=c["head_dim"], vocab_size=c["vocab_size"], num_hidden_layers=1)
    assert plan.layer_params(c) == _decoder_layer_matmul_params(qwen)
    c = plan.PLAN_SHAPES["qwen3-30b-a3b"]
    moe = Qwen3MoeConfig(hidden_size=c["hidden_size"], intermediate_size=c["intermediate_size"],
                         num_attention_heads=c["num_attention_heads"], num_key_value_heads=c["num_key_value_heads"],
                         head_dim=c["head_dim"], vocab_size=c["vocab_size"], num_experts=c["experts"],
                         num_experts_per_tok=c["active"], moe_intermediate_size=c["moe_intermediate"],
                         num_hidden_layers=1, decoder_sparse_step=1, mlp_only_layers=[])
    assert plan.layer_params(c) == _decoder_layer_matmul_params(moe)
    # the public model sizes: ~70B, ~32B, ~30B resident / ~3B active (embeddings and heads included)
    total = {name: plan.layer_params(s) * s["num_hidden_layers"] + 2 * s["vocab_size"] * s["hidden_size"]
             for name, s in plan.PLAN_SHAPES.items()}
    assert 69e9 < total["llama3-70b-class"] < 72e9 and 31e9 < total["qwen3-32b"] < 34e9
    assert 29e9 < total["qwen3-30b-a3b"] < 31.5e9


def test_a_shard_group_divides_the_weights_and_hides_the_gather_behind_compute():
    c = plan.PLAN_SHAPES["llama3-70b-class"]
    one, eight = plan.plan_shard_group(c, 1), plan.plan_shard_group(c, 8)
    assert abs(eight.memory_gib["weights (shard)"] * 8 - one.memory_gib["weights (shard)"]) < 1e-9
    assert one.memory_gib["gathered layers"] == 0 and eight.memory_gib["gathered layers"] > 0
    assert one.gather_s == 0 and eight.microbatch_s >= max(eight.compute_s, eight.gather_s)
    # a 70B bf16 target does not fit one H200 with headroom, a group of two does
    assert plan.smallest_fitting_group(c, 8, 125.0).group == 2
    # starved of bandwidth the gather is the bound: time = all layers' gathers + the exposed first one
    slow = plan.plan_shard_group(c, 8, allgather_gbps=1.0)
    layer = plan.layer_params(c) * 2 * 7 / 8 / 1e9
    assert abs(slow.microbatch_s - (plan.captured_layers(c) + 1) * layer) < 1e-6
