"""Multimodal checkpoints resolve to their text model, with the checkpoint's real weights."""

import pytest
import torch

from dflash_train.architectures.drafter import default_target_layer_ids
from dflash_train.target.capture import TargetCapture, load_target_head, load_target_model, read_target_config

TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=1000)
VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)


def _qwen3_5(path):
    from transformers.models.qwen3_5 import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    text = dict(TEXT, linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
                linear_value_head_dim=16, layer_types=["linear_attention", "full_attention"] * 2)
    return Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=text, vision_config=VISION))


def _qwen3_vl(path):
    from transformers.models.qwen3_vl import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    return Qwen3VLForConditionalGeneration(Qwen3VLConfig(text_config=TEXT, vision_config=VISION))


@pytest.mark.parametrize("build", [_qwen3_5, _qwen3_vl], ids=["qwen3.5 (text class)", "qwen3-vl (whole model)"])
def test_multimodal_target_captures_its_language_model(tmp_path, build):
    torch.manual_seed(0)
    mm = build(tmp_path).eval()
    mm.save_pretrained(tmp_path)
    cfg = read_target_config(tmp_path)
    assert cfg.num_hidden_layers == 4 and cfg.vocab_size == 1000 and cfg.hidden_size == 64
    model = load_target_model(tmp_path, torch.float32, torch.device("cpu"))
    assert "Vision" not in type(model).__name__ or hasattr(model, "lm_head")
    ids = torch.randint(0, 1000, (2, 11))
    with torch.no_grad():
        ref = mm.model.language_model(input_ids=ids, output_hidden_states=True).hidden_states
    layer_ids = [0, 2]
    cap = TargetCapture.from_model(model, layer_ids)
    torch.testing.assert_close(cap(ids), torch.cat([ref[i + 1] for i in layer_ids], -1), rtol=1e-5, atol=1e-5)
    assert torch.equal(cap.lm_head.weight, mm.lm_head.weight)
    assert torch.equal(cap.embed_tokens.weight, mm.get_input_embeddings().weight)
    assert cap.num_layers == 4 and default_target_layer_ids(cap.num_layers, 1) == [2]
    head = load_target_head(tmp_path, torch.float32, torch.device("cpu"))  # a split drafter rank's view
    assert torch.equal(head.embed_tokens.weight, mm.get_input_embeddings().weight)
    assert torch.equal(head.lm_head.weight, mm.lm_head.weight)


def test_a_checkpoint_without_its_lm_head_is_a_user_error_naming_the_tensor(tmp_path):
    """The split placement's drafter ranks read the head from safetensors: a checkpoint that lacks it (and does
    not tie it to the embedding) is the user's to fix: one message (exit 2), not a KeyError traceback."""
    from safetensors.torch import load_file, save_file
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from dflash_train.errors import ModelError, is_user_error

    torch.manual_seed(0)
    Qwen3ForCausalLM(Qwen3Config(**TEXT, tie_word_embeddings=False)).save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    del weights["lm_head.weight"]
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelError, match=r"lm_head \(lm_head.weight\) is not in .*safetensors") as err:
        load_target_head(tmp_path, torch.float32, torch.device("cpu"))
    assert is_user_error(err.value)
