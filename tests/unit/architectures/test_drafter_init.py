"""`drafter.init_from_target`: the drafter's layers start as copies of the target's last layers."""

import json
from pathlib import Path

import pytest
import torch
import yaml

from dflash_train.cli import main
from dflash_train.config.load import load_config
from dflash_train.errors import ConfigError
from dflash_train.architectures.dflash.model import DFlashDrafter
from dflash_train.architectures.family.config import make_drafter_config
from dflash_train.architectures.init_from_target import init_drafter_from_target, init_layer_ids
from dflash_train.architectures.io import load_drafter
from dflash_train.target.capture import read_target_config

COPIED = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
          "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight", "input_layernorm.weight",
          "post_attention_layernorm.weight")


def _drafter(target_dir: Path, layers: int = 2, **shape) -> DFlashDrafter:
    torch.manual_seed(0)
    cfg = make_drafter_config(read_target_config(target_dir), num_draft_layers=layers, block_size=4,
                              target_layer_ids=[1, 3], mask_token_id=16, **shape)
    return DFlashDrafter(cfg)


def _target_state(target_dir: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).state_dict()


def test_layer_choice_is_the_last_layers_in_order():
    assert init_layer_ids(30, 2) == [28, 29]
    assert init_layer_ids(6, 1) == [5]
    assert init_layer_ids(6, 6) == list(range(6))
    with pytest.raises(ConfigError, match="drafter.init_from_target.*7 layers.*only 6"):
        init_layer_ids(6, 7)


@pytest.fixture(scope="module")
def odd_norm_target(tmp_path_factory, tokenizer_dir) -> Path:
    """The tiny Llama target with random (not all-ones) norm weights, so a copied norm differs from a fresh one."""
    from conftest import make_tiny_target
    from transformers import AutoModelForCausalLM

    out = make_tiny_target(tmp_path_factory.mktemp("odd-norm-target"), tokenizer_dir, seed=3)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    model.save_pretrained(out)
    return out


def test_layers_and_final_norm_equal_the_targets_last_layers(odd_norm_target):
    drafter = _drafter(odd_norm_target)
    fc_before = drafter.fc.weight.clone()
    state = _target_state(odd_norm_target)
    assert not torch.equal(state["model.norm.weight"], torch.ones(64))
    assert init_drafter_from_target(drafter, odd_norm_target) == [4, 5]
    own = drafter.state_dict()
    for j, lid in enumerate([4, 5]):
        for name in COPIED:
            assert torch.equal(own[f"layers.{j}.{name}"], state[f"model.layers.{lid}.{name}"]), (j, name)
        assert torch.equal(own[f"layers.{j}.self_attn.q_norm.weight"], torch.ones(16))  # Llama has none: stays 1
        assert torch.equal(own[f"layers.{j}.self_attn.k_norm.weight"], torch.ones(16))
    assert torch.equal(own["norm.weight"], state["model.norm.weight"])
    assert torch.equal(own["fc.weight"], fc_before)  # no counterpart in the target: left as initialised
    assert torch.equal(own["hidden_norm.weight"], torch.ones(64))


def test_qwen3_target_q_k_norms_are_copied_too(tmp_path, tokenizer_dir):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(1)
    cfg = Qwen3Config(vocab_size=49152, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True)
    model = Qwen3ForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(tmp_path)
    drafter = _drafter(tmp_path, layers=1)
    assert init_drafter_from_target(drafter, tmp_path) == [3]
    src = model.model.layers[3]
    got = drafter.layers[0]
    for name in ("q_norm", "k_norm", "q_proj", "o_proj"):
        assert torch.equal(getattr(got.self_attn, name).weight, getattr(src.self_attn, name).weight), name
    assert torch.equal(got.mlp.down_proj.weight, src.mlp.down_proj.weight)
    assert torch.equal(drafter.norm.weight, model.model.norm.weight)


@pytest.mark.parametrize("shape,tensor", [({"intermediate_size": 64}, "mlp.gate_proj"),
                                          ({"num_attention_heads": 2, "num_key_value_heads": 2}, "self_attn.q_proj")])
def test_a_narrowed_drafter_is_refused_with_both_shapes(tiny_target_dir, shape, tensor):
    drafter = _drafter(tiny_target_dir, **shape)
    before = {k: v.clone() for k, v in drafter.state_dict().items()}
    with pytest.raises(ConfigError) as e:
        init_drafter_from_target(drafter, tiny_target_dir)
    msg = str(e.value)
    assert "drafter.init_from_target" in msg and tensor in msg and "shape" in msg and "set drafter.init_from_target=false" in msg
    assert all(torch.equal(v, before[k]) for k, v in drafter.state_dict().items())  # refused: nothing changed


def test_config_key_parses_and_defaults_off(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"data": {"train_files": ["x.jsonl"]}}))
    assert load_config(path).drafter.init_from_target is False
    assert load_config(path, ["drafter.init_from_target=true"]).drafter.init_from_target is True
    with pytest.raises(ConfigError, match="drafter.init_from_target"):
        load_config(path, ["drafter.init_from_target=sometimes"])


def _config(path: Path, target: Path, data: Path, **drafter) -> Path:
    cfg = {
        "target": {"path": str(target)},
        "drafter": {"num_draft_layers": 2, "block_size": 4, "attention_backend": "sdpa", "init_from_target": True,
                    **drafter},
        "data": {"train_files": [str(data)], "max_length": 256, "token_budget": 1024, "max_batch_size": 4},
        "objective": {"max_anchors": 16, "gamma": 4.0},
        "optim": {"lr": 1e-3, "epochs": 10, "warmup_ratio": 0.05},
        "run": {"device": "cpu", "log_every": 2, "save_every": 4, "keep_last": 3, "progress_bar": False},
    }
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_training_with_the_key_starts_from_the_target_and_resumes(tmp_path, tiny_target_dir, counting_jsonl):
    cfg = _config(tmp_path / "c.yaml", tiny_target_dir, counting_jsonl)
    run = tmp_path / "R"
    assert main(["train", str(cfg), "--run-dir", str(run), "--max-steps", "4"]) == 0
    state = _target_state(tiny_target_dir)
    # a step-4 checkpoint moved away from, but stays near, the target's layer 5 (4 small AdamW steps)
    d4 = load_drafter(run / "checkpoints" / "step-00000004" / "drafter")
    w4, w_t = d4.layers[1].mlp.up_proj.weight, state["model.layers.5.mlp.up_proj.weight"]
    assert not torch.equal(w4, w_t) and (w4 - w_t).abs().max() < 0.05 < w_t.abs().max()
    # the resume loads the checkpoint's weights (not a fresh copy of the target's) and finishes
    assert main(["train", str(cfg), "--run-dir", str(run), "--resume", "optim.max_steps=8"]) == 0
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [2, 4, 6, 8]
    assert json.loads((run / "status.json").read_text())["phase"] == "done"
    final = load_drafter(run / "export")
    assert (final.layers[1].mlp.up_proj.weight - w_t).abs().max() < 0.1


def test_training_refuses_a_narrowed_drafter(tmp_path, tiny_target_dir, counting_jsonl, capsys):
    cfg = _config(tmp_path / "c.yaml", tiny_target_dir, counting_jsonl, intermediate_size=32)
    assert main(["train", str(cfg), "--run-dir", str(tmp_path / "R"), "--max-steps", "2"]) == 2
    err = capsys.readouterr().err
    assert "drafter.init_from_target" in err and "mlp.gate_proj" in err
