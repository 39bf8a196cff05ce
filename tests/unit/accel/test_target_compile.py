"""`target.compile` on CPU: the config key, the early refusal on a CPU device, the capture unchanged
with the option off, and the compiled wiring traced by Dynamo's "eager" backend (no inductor): one
graph per layer class for every layer, batch 1 and >= 2 warmed, new lengths never recompile, the
early stop and `with_final` still work, a recompile-limit hit raises. Inductor numerics are checked
on a GPU (tests/gpu/)."""

import json

import pytest
import torch
import yaml

from dflash_train.config.load import config_from_dict, load_config
from dflash_train.errors import ConfigError
from dflash_train.accel import compile as compile_layer
from dflash_train.target.capture import TargetCapture, _warm_up_lengths


def _qwen3(layers=6, seed=0):
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(seed)
    cfg = Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, vocab_size=1000)
    return AutoModelForCausalLM.from_config(cfg).eval().requires_grad_(False)


def _ids(b, s, seed=0):
    return torch.randint(0, 1000, (b, s), generator=torch.Generator().manual_seed(seed))


def _no_instance_forward(model) -> bool:
    return all("forward" not in vars(layer) for layer in model.model.layers)


# ------------------------------------------------------------------------------------------ config


def test_key_is_off_by_default_and_typed():
    assert config_from_dict({}).target.compile is False
    assert load_config(None, ["target.compile=true", "run.device=cuda"]).target.compile is True
    assert config_from_dict({"target": {"compile": True}}).target.compile is True  # auto: checked at start
    with pytest.raises(ConfigError, match="target.compile"):
        config_from_dict({"target": {"compile": "fast"}})


def test_cpu_device_is_refused_at_config_load():
    with pytest.raises(ConfigError, match=r"'target.compile'.*CUDA.*cpu.*target.compile=false"):
        config_from_dict({"target": {"compile": True}, "run": {"device": "cpu"}})
    config_from_dict({"target": {"compile": False}, "run": {"device": "cpu"}})  # off: fine


def test_cli_names_the_key_before_anything_starts(tmp_path, capsys):
    from dflash_train.cli import main

    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"run": {"device": "cpu"}}))
    assert main(["train", str(path), "target.compile=true", "--run-dir", str(tmp_path / "R")]) == 2
    assert "target.compile" in capsys.readouterr().err
    assert not (tmp_path / "R").exists()


def test_auto_resolving_to_cpu_is_refused_before_weights_load(tiny_target_dir, monkeypatch):
    from dflash_train.architectures import architecture
    from dflash_train.train.start import rank_checks
    from dflash_train.train.start import target_load

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(target_load, "load_target_model", lambda *a, **k: pytest.fail("weights loaded"))
    cfg = config_from_dict({"target": {"path": str(tiny_target_dir), "compile": True}})
    with pytest.raises(ConfigError, match=r"'target.compile'.*device is cpu \(run.device=auto\)"):
        rank_checks.plan_run(cfg, architecture("dflash"))


def test_a_cpu_model_refuses_the_compiled_capture():
    with pytest.raises(ConfigError, match=r"'target.compile'.*target is on cpu"):
        TargetCapture.from_model(_qwen3(), [1, 3], compile=True)


# ------------------------------------------------------------------------------------------ option off


def test_option_off_capture_is_unchanged():
    model = _qwen3()
    graphs = compile_layer.graphs_compiled()
    cap = TargetCapture.from_model(model, [1, 3])
    assert cap.compile is False and cap._forwards == [] and cap.warm_up() == {}
    ids = _ids(2, 23)
    with torch.no_grad():
        out = model.model(input_ids=ids, use_cache=False, output_hidden_states=True)
    hidden, final = cap.capture(ids, with_final=True)
    # hidden_states[i + 1] is the output of layer i (the last entry is after the final norm)
    assert torch.equal(hidden, torch.cat([out.hidden_states[2], out.hidden_states[4]], -1))
    assert torch.equal(final, out.last_hidden_state) and torch.equal(cap(ids), hidden)
    assert _no_instance_forward(model) and compile_layer.graphs_compiled() == graphs


# ------------------------------------------------------------------------------------------ compiled wiring


def test_warm_up_lengths_are_primes_clear_of_model_dimensions():
    for near, avoid in ((257, {64, 16, 2, 3}), (4096, {4096, 128, 2, 3}), (4093, {4093, 128}), (1, set())):
        lengths = _warm_up_lengths(near, avoid)
        assert len(set(lengths)) == 3 and all(n >= max(near, 5) and n not in avoid for n in lengths)
        assert all(all(n % d for d in range(2, n)) for n in lengths)


def test_compiled_capture_equals_eager_stops_early_and_restores_the_layers(eager_backend):
    model = _qwen3(layers=8)
    eager = TargetCapture.from_model(model, [1, 4])
    comp = TargetCapture.from_model(model, [1, 4], compile=True)
    assert _no_instance_forward(model)  # compiled forwards live on the layers only during a capture
    ran = []
    for i, layer in enumerate(model.model.layers):
        layer.register_forward_pre_hook(lambda _m, _a, i=i: ran.append(i))
    for b, s in ((2, 31), (1, 17), (3, 40)):
        ids = _ids(b, s, seed=s)
        ran.clear()
        got = comp(ids)
        assert ran == [0, 1, 2, 3, 4]  # the early stop: layers after the last captured one never run
        torch.testing.assert_close(got, eager(ids), rtol=1e-5, atol=1e-6)
        ran.clear()
        got, final = comp.capture(ids, with_final=True)
        assert ran == list(range(8))
        ref, ref_final = eager.capture(ids, with_final=True)
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(final, ref_final, rtol=1e-5, atol=1e-6)
        assert _no_instance_forward(model)
    graphs = compile_layer.graphs_compiled()
    with torch.no_grad():  # the model's own forward (speculative decoding, KV cache) stays eager
        model(input_ids=_ids(1, 9), use_cache=True)
    assert compile_layer.graphs_compiled() == graphs


def test_thirty_two_layers_share_two_graphs_and_new_lengths_never_recompile(eager_backend):
    model = _qwen3(layers=32)
    cap = TargetCapture.from_model(model, [1, 9, 17, 25], compile=True)
    assert len({fn.func for fn in cap._forwards}) == 1  # one compiled callable for the layer class
    info = cap.warm_up(length=40)
    # batch >= 2 and batch 1 (Dynamo specialises size 1), shared by all 32 layers; the warm-up's own
    # check (a third batch size and length) compiled nothing
    assert info["target_compiled_graphs"] == 2 and info["target_recompiled_after_warmup"] == 0
    recompiles, graphs = compile_layer.recompiles(), compile_layer.graphs_compiled()
    for b, s in ((4, 100), (1, 77), (2, 300), (5, 33), (2, 64)):
        cap.capture(_ids(b, s), with_final=s % 2 == 0)
    assert compile_layer.recompiles() == recompiles and compile_layer.graphs_compiled() == graphs


@pytest.mark.parametrize("one_row,several_rows,batches", [(False, True, (4, 2, 3)), (True, False, (1, 1))])
def test_warm_up_compiles_only_the_batch_kinds_the_data_has(eager_backend, one_row, several_rows, batches):
    model = _qwen3(layers=4)
    cap = TargetCapture.from_model(model, [1, 2], compile=True)
    info = cap.warm_up(length=40, one_row=one_row, several_rows=several_rows)
    assert info["target_compiled_graphs"] == 1 and info["target_recompiled_after_warmup"] == 0
    graphs = compile_layer.graphs_compiled()
    for i, b in enumerate(batches):
        cap.capture(_ids(b, 50 + 7 * i))
    assert compile_layer.graphs_compiled() == graphs


def test_a_recompile_limit_hit_raises_instead_of_running_eager(eager_backend, monkeypatch):
    """The compile layer's limit (`compile.RECOMPILE_LIMIT`, set on every compiled call) is Dynamo's."""
    model = _qwen3(layers=4)
    cap = TargetCapture.from_model(model, [1, 2], compile=True)
    monkeypatch.setattr(compile_layer, "RECOMPILE_LIMIT", 1)
    cap(_ids(2, 30))
    with pytest.raises(torch._dynamo.exc.FailOnRecompileLimitHit):
        cap(_ids(1, 30))  # batch 1 needs a second graph: past the limit, an error (fullgraph)
    assert _no_instance_forward(model)


def test_trainer_warm_up_compiles_the_target_first_and_steps_never_compile(tmp_path, tiny_target_dir,
                                                                           counting_jsonl, monkeypatch, eager_backend):
    """The trainer's wiring on CPU, with the device check lifted: the warm-up compiles the target
    (reported in status.json) and the training steps (various batch sizes and lengths) add nothing."""
    import dflash_train.config.validate as config_mod
    from dflash_train.train.start import rank_checks
    from dflash_train.train import trainer
    from dflash_train.train.start import warmup

    monkeypatch.setattr(config_mod, "validate_compile_device", lambda *a: None)
    monkeypatch.setattr(rank_checks, "validate_compile_device", lambda *a: None)
    cfg = config_from_dict({
        "target": {"path": str(tiny_target_dir), "compile": True},
        "drafter": {"num_draft_layers": 1, "block_size": 4, "attention_backend": "sdpa"},
        "data": {"train_files": [str(counting_jsonl)], "max_length": 256, "token_budget": 1024, "max_batch_size": 4},
        "objective": {"max_anchors": 16, "gamma": 4.0},
        "optim": {"lr": 3e-3, "epochs": 10, "warmup_ratio": 0.05},
        "run": {"device": "cpu", "log_every": 1, "save_every": 100, "progress_bar": False, "eval_every": 0},
    })
    after_warm_up = []
    original = warmup.warm_up

    def warm_up(*args, **kwargs):
        info = original(*args, **kwargs)
        after_warm_up.append(compile_layer.graphs_compiled())
        return info

    monkeypatch.setattr(warmup, "warm_up", warm_up)
    trainer.train(cfg, tmp_path / "R", max_steps=6)
    assert compile_layer.graphs_compiled() == after_warm_up[0]  # no step compiled anything
    status = json.loads((tmp_path / "R" / "status.json").read_text())
    assert status["phase"] == "done", status
    # this data's plan has batches of several rows only (budget 1024, max 4 rows): one graph for all layers
    assert status["target_compiled_graphs"] == 1 and status["target_recompiled_after_warmup"] == 0
    records = [json.loads(line) for line in (tmp_path / "R" / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 6 and records[-1]["recompiles"] == records[0]["recompiles"]


def test_flex_attention_on_a_cpu_training_run_is_refused_at_config_load():
    with pytest.raises(ConfigError, match=r"'drafter.attention_backend'.*CUDA.*cpu.*attention_backend=sdpa"):
        config_from_dict({"drafter": {"attention_backend": "flex"}, "run": {"device": "cpu"}})
    for backend in ("sdpa", "auto"):
        config_from_dict({"drafter": {"attention_backend": backend}, "run": {"device": "cpu"}})
    config_from_dict({"drafter": {"attention_backend": "flex"}, "run": {"device": "cuda"}})
