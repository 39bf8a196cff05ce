"""Config loading: types, unknown keys, overrides, cross-field checks, shipped configs."""

from pathlib import Path

import pytest
import yaml

from dflash_train.config.load import config_from_dict, config_to_dict, dump_config, load_config
from dflash_train.config.validate import validate_against_target
from dflash_train.errors import ConfigError

CONFIGS = Path(__file__).resolve().parents[3] / "configs"


def test_defaults_are_the_published_recipe():
    cfg = config_from_dict({})
    assert (cfg.drafter.block_size, cfg.drafter.num_draft_layers, cfg.objective.max_anchors, cfg.objective.gamma) == (16, 5, 512, 7.0)
    assert (cfg.optim.lr, cfg.optim.warmup_ratio, cfg.optim.weight_decay, cfg.optim.grad_clip) == (6e-4, 0.04, 0.0, 1.0)


def test_unknown_key_names_the_key_and_lists_valid_ones():
    with pytest.raises(ConfigError) as e:
        config_from_dict({"optim": {"learning_rate": 1e-3}})
    msg = str(e.value)
    assert "optim.learning_rate" in msg and "lr" in msg and "warmup_ratio" in msg
    with pytest.raises(ConfigError, match="unknown config key 'optimizer'.*valid keys.*optim"):
        config_from_dict({"optimizer": {}})


@pytest.mark.parametrize("tree,key", [
    ({"drafter": {"block_size": "16"}}, "drafter.block_size"),
    ({"drafter": {"block_size": 16.5}}, "drafter.block_size"),
    ({"drafter": {"attention_backend": "flash"}}, "drafter.attention_backend"),
    ({"run": {"progress_bar": "yes"}}, "run.progress_bar"),
    ({"drafter": {"target_layer_ids": [1, "x"]}}, "drafter.target_layer_ids[1]"),
    ({"optim": {"betas": [0.9]}}, "optim.betas"),
    ({"data": []}, "data"),
    ({"objective": {"slot_weighting": "pace"}}, "objective.slot_weighting.*'dpace'"),
    ({"optim": {"schedule": "linear"}}, "optim.schedule"),
    ({"objective": {"distill_weight": "half"}}, "objective.distill_weight"),
])
def test_wrong_types_name_the_key(tree, key):
    with pytest.raises(ConfigError, match=key.replace("[", r"\[").replace("]", r"\]")):
        config_from_dict(tree)


@pytest.mark.parametrize("tree,key", [
    ({"objective": {"max_anchors": 0}}, "objective.max_anchors"),
    ({"drafter": {"block_size": 1}}, "drafter.block_size"),
    ({"drafter": {"target_layer_ids": [3, 3]}}, "drafter.target_layer_ids"),
    ({"data": {"max_length": 20}}, "data.max_length"),
    ({"data": {"token_budget": 100, "max_length": 200}}, "data.token_budget"),
    ({"optim": {"warmup_ratio": 1.5}}, "optim.warmup_ratio"),
    ({"objective": {"max_anchors_per_batch": -1}}, "objective.max_anchors_per_batch"),
    ({"objective": {"distill_weight": 1.5}}, "objective.distill_weight"),
    ({"objective": {"distill_weight": -0.1}}, "objective.distill_weight"),
    ({"objective": {"distill_temperature": 0.0}}, "objective.distill_temperature"),
    ({"objective": {"acceptance_floor": 0.0}}, "objective.acceptance_floor"),
    ({"objective": {"dpace_alpha": 1.5}}, "objective.dpace_alpha.*in \\[0, 1\\]"),
    ({"objective": {"dpace_alpha": -0.1}}, "objective.dpace_alpha"),
    ({"optim": {"decay_ratio": 0.0}}, "optim.decay_ratio"),
    ({"optim": {"decay_ratio": 1.2}}, "optim.decay_ratio"),
    ({"optim": {"schedule": "wsd", "warmup_ratio": 0.5, "decay_ratio": 0.6}}, "optim.decay_ratio"),
    ({"parallel": {"placement": "split"}, "run": {"eval_every": 0}, "objective": {"distill_weight": 0.5}},
     "objective.distill_weight.*split"),
    ({"drafter": {"sliding_window": 0}}, "drafter.sliding_window.*a positive integer or null, got 0"),
    ({"drafter": {"sliding_window": 16}}, r"drafter.sliding_window.*> drafter.block_size = 16.*last 1 slot"),
    ({"drafter": {"block_size": 8, "sliding_window": 5}}, r"drafter.sliding_window.*last 4 slot"),
    ({"drafter": {"output_multiplier": 0.0}}, "drafter.output_multiplier"),
    ({"drafter": {"final_logit_softcapping": 0.0}}, "drafter.final_logit_softcapping.*null"),
    ({"drafter": {"final_logit_softcapping": -3.0}}, "drafter.final_logit_softcapping"),
])
def test_cross_field_checks(tree, key):
    with pytest.raises(ConfigError, match=key):
        config_from_dict(tree)


def test_reference_field_keys_default_to_dflash_and_accept_a_window_past_the_block():
    d = config_from_dict({}).drafter
    assert (d.sliding_window, d.causal, d.output_multiplier, d.final_logit_softcapping) == (None, False, 1.0, None)
    d = config_from_dict({}, ["drafter.sliding_window=17", "drafter.causal=true", "drafter.final_logit_softcapping=20",
                              "drafter.output_multiplier=0.196"]).drafter
    assert (d.sliding_window, d.causal, d.output_multiplier, d.final_logit_softcapping) == (17, True, 0.196, 20.0)


def test_recipe_defaults_are_the_measured_winners_only():
    """Acceptance weighting and WSD won at equal steps (QUALITY.md) and are the defaults; distillation lost,
    so it stays off."""
    cfg = config_from_dict({})
    o, op = cfg.objective, cfg.optim
    assert (o.slot_weighting, o.distill_weight, o.distill_temperature, op.schedule) == ("acceptance", 0.0, 1.0, "wsd")
    # warmup + decay may exceed 1 under the cosine schedule, where decay_ratio is unused; not under wsd
    cos = config_from_dict({"optim": {"schedule": "cosine", "warmup_ratio": 0.5, "decay_ratio": 0.6}})
    assert cos.optim.schedule == "cosine"
    with pytest.raises(ConfigError, match="optim.decay_ratio"):
        config_from_dict({"optim": {"warmup_ratio": 0.5, "decay_ratio": 0.6}})
    wsd = config_from_dict({}, ["optim.decay_ratio=0.3", "objective.distill_weight=0.2"])
    assert (wsd.optim.schedule, wsd.optim.decay_ratio, wsd.objective.distill_weight) == ("wsd", 0.3, 0.2)


def test_overrides_are_typed_and_dotted():
    cfg = config_from_dict({}, ["optim.lr=3e-4", "drafter.target_layer_ids=[1, 5]", "drafter.mask_token_id=null",
                                "run.progress_bar=false", "data.train_files=[a.jsonl, b.jsonl]"])
    assert cfg.optim.lr == 3e-4 and cfg.drafter.target_layer_ids == [1, 5] and cfg.drafter.mask_token_id is None
    assert cfg.run.progress_bar is False and cfg.data.train_files == ["a.jsonl", "b.jsonl"]
    with pytest.raises(ConfigError, match="optim.lrr"):
        config_from_dict({}, ["optim.lrr=1"])
    with pytest.raises(ConfigError, match="must look like"):
        config_from_dict({}, ["optim.lr"])


def test_target_checks_need_only_the_target_config():
    cfg = config_from_dict({"drafter": {"target_layer_ids": [1, 30]}})
    with pytest.raises(ConfigError, match=r"names layer 30.*30 decoder layers"):
        validate_against_target(cfg, num_target_layers=30, vocab_size=100)
    cfg = config_from_dict({"drafter": {"mask_token_id": 100}})
    with pytest.raises(ConfigError, match="outside the target's vocabulary"):
        validate_against_target(cfg, num_target_layers=30, vocab_size=100)


def test_resolved_config_round_trips_with_every_default(tmp_path):
    cfg = config_from_dict({"optim": {"lr": 1e-3}})
    dump_config(cfg, tmp_path / "config.yaml")
    written = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert written["optim"]["lr"] == 1e-3 and written["objective"]["gamma"] == 7.0 and "seed" in written["run"]
    assert config_to_dict(load_config(tmp_path / "config.yaml")) == config_to_dict(cfg)


def test_file_errors_name_the_file(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("drafter:\n  blok_size: 4\n")
    with pytest.raises(ConfigError, match=r"drafter.blok_size.*bad.yaml"):
        load_config(bad)


@pytest.mark.parametrize("name", sorted(p.name for p in CONFIGS.glob("*.yaml")))
def test_shipped_configs_load(name):
    load_config(CONFIGS / name)


def test_shipped_gpu_configs_match_their_descriptions():
    q = load_config(CONFIGS / "qwen3-8b.yaml")
    assert (q.drafter.block_size, q.objective.max_anchors, q.objective.gamma) == (16, 512, 7.0)
    f = load_config(CONFIGS / "qwen-27b-8gpu-split.yaml")
    assert (f.drafter.block_size, f.objective.max_anchors, f.objective.gamma) == (32, 1024, 10.0)
    assert (f.data.token_budget, f.data.max_batch_size) == (49152, 64)
    assert (f.parallel.placement, f.parallel.target_ranks, f.run.eval_every) == ("split", 5, 0)
    assert (f.drafter.num_attention_heads, f.drafter.intermediate_size) == (32, 17408)
    d = load_config(CONFIGS / "qwen-27b-dflash2-fp8.yaml")
    assert (d.drafter.architecture, d.drafter.block_size, d.objective.max_anchors, d.target.quantize) == \
        ("dflash2", 8, 512, "fp8")
    assert (d.drafter.num_attention_heads, d.drafter.intermediate_size, d.parallel.placement) == (32, 17408, "colocated")
    assert q.target.compile and f.target.compile and d.target.compile  # the GPU configs compile the target


def test_a_deprecated_key_is_named_where_it_was_written(tmp_path, caplog, monkeypatch):
    """An old key given as an override is named with that override, not blamed on the YAML file."""
    import logging

    from dflash_train.config import load as config_load

    monkeypatch.setattr(config_load, "_WARNED", set())  # warned once per process
    mixed, plain = tmp_path / "mixed.yaml", tmp_path / "plain.yaml"
    mixed.write_text(yaml.safe_dump({"drafter": {"architecture": "dflash2", "selector_top_k": 12}}))
    plain.write_text(yaml.safe_dump({"drafter": {"architecture": "dflash2"}}))
    with caplog.at_level(logging.WARNING, logger="dflash_train.config.load"):
        load_config(mixed, ["drafter.selector_rank=4"])
        load_config(plain, ["drafter.selector_rank=8"])
    first, second = [r.getMessage() for r in caplog.records if "deprecated" in r.getMessage()]
    assert f"drafter.selector_top_k -> dflash2.selector_top_k (in {mixed})" in first, first
    assert "drafter.selector_rank -> dflash2.selector_rank (override 'drafter.selector_rank=4')" in first, first
    assert str(plain) not in second and "(override 'drafter.selector_rank=8')" in second, second


def test_a_cross_field_refusal_names_the_override_it_comes_from():
    """The refused key is the file's, the other key the check names was set on the command line: both are named."""
    with pytest.raises(ConfigError, match=r"set drafter.attention_backend=sdpa \(or auto\) \(c.yaml with the override "
                                          r"'run.device=cpu'\)$"):
        config_from_dict({"drafter": {"attention_backend": "flex"}}, ["run.device=cpu"], "c.yaml")
    with pytest.raises(ConfigError, match=r"\(c.yaml\)$"):  # both in the file: the file
        config_from_dict({"drafter": {"attention_backend": "flex"}, "run": {"device": "cpu"}}, [], "c.yaml")
