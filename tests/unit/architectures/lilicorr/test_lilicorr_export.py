"""The LiLiCorr export as the engines load it, checked by an independent reader written from the specification: the
config.json's fields (no loader defaults: every `lilicorr_*` field present), the head's tensors rebuilt by name and
shape from the config.json alone and found in model.safetensors both ways (none missing, none surplus), and drafts
reproduced from the file's tensors by the specification's head and walk; the export reloads through
`architectures.io`, and one without a head field is refused."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from _lilicorr_reference import head_scores, walk

from dflash_train.architectures import architecture, architecture_of_export
from dflash_train.architectures.attention import sdpa_attention
from dflash_train.architectures.io import load_drafter, save_drafter
from dflash_train.config.load import config_from_dict
from dflash_train.target.capture import load_target_model

FIELDS = ("lilicorr_candidate_topk", "lilicorr_hidden_size", "lilicorr_num_layers", "lilicorr_num_heads",
          "lilicorr_mlp_ratio", "lilicorr_factor_dim", "lilicorr_vector_eps", "lilicorr_logit_scale")


@pytest.fixture(scope="module")
def target(tiny_target_dir):
    return load_target_model(tiny_target_dir, torch.float32, torch.device("cpu"))


def exported(target, folder, width=32):
    cfg = config_from_dict({"drafter": {"architecture": "lilicorr", "block_size": 6, "num_draft_layers": 2},
                            "lilicorr": {"candidate_topk": 4, "head_hidden_size": width, "head_num_layers": 2,
                                         "head_num_heads": 4, "factor_dim": 16, "logit_scale": 6.0,
                                         "vector_eps": 1e-3}})
    torch.manual_seed(0)
    arch = architecture("lilicorr")
    d = arch.drafter_class(arch.config_for_run(target.config, cfg, [1, 4], 16))
    with torch.no_grad():
        for p in d.lilicorr.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return d.eval(), save_drafter(d, folder, dtype="float32")


def expected_head(config: dict) -> dict[str, tuple]:
    """The `lilicorr.*` tensors an engine builds from config.json, by the specification's table."""
    own = config["dflash_config"]
    big, blocks = config["hidden_size"], own["block_size"]
    h = own["lilicorr_hidden_size"] or big
    heads, k, f = own["lilicorr_num_heads"], own["lilicorr_candidate_topk"], own["lilicorr_factor_dim"]
    inner = int(h * own["lilicorr_mlp_ratio"])
    shapes = {"pass_hidden_proj.weight": (h, big), "pass_hidden_proj.bias": (h,), "feature_mlp.0.weight": (5,),
              "feature_mlp.0.bias": (5,), "feature_mlp.1.weight": (h, 5), "feature_mlp.1.bias": (h,),
              "feature_mlp.3.weight": (h, h), "feature_mlp.3.bias": (h,), "slot_embedding": (1, 1, blocks - 1, 1, h),
              "rank_embedding": (1, 1, 1, k, h), "relative_slot_bias": (heads, 2 * blocks - 1),
              "same_slot_bias": (heads,), "context_proj.weight": (h, big), "context_proj.bias": (h,),
              "output_norm.weight": (h,), "anchor_norm.weight": (h,), "factor_input_proj.weight": (h, 3 * h),
              "factor_input_proj.bias": (h,)}
    if h != big:
        shapes.update({"token_proj.weight": (h, big), "token_proj.bias": (h,)})
    for name in ("out_head", "in_head", "anchor_out_head"):
        shapes.update({f"{name}.weight": (f, h), f"{name}.bias": (f,)})
    for i in range(own["lilicorr_num_layers"]):
        p = f"layers.{i}."
        shapes.update({p + "attn_norm.weight": (h,), p + "mlp_norm.weight": (h,), p + "attn.in_proj_weight": (3 * h, h),
                       p + "attn.in_proj_bias": (3 * h,), p + "attn.out_proj.weight": (h, h),
                       p + "attn.out_proj.bias": (h,), p + "mlp.0.weight": (inner, h), p + "mlp.0.bias": (inner,),
                       p + "mlp.2.weight": (h, inner), p + "mlp.2.bias": (h,)})
    return {"lilicorr." + k: v for k, v in shapes.items()}


@pytest.mark.parametrize("width", [32, 0])
def test_an_independent_reader_finds_the_engines_layout_and_reproduces_the_drafts(target, tmp_path, width):
    d, out = exported(target, tmp_path / "E", width)
    config = json.loads((out / "config.json").read_text())
    own = config["dflash_config"]
    assert config["architectures"] == ["LiLiCorrDraftModel"] and config["model_type"] == "qwen3"
    assert config["tie_word_embeddings"] is False and "draft_vocab_size" not in config
    assert config["block_size"] == own["block_size"] == 6 and config["num_target_layers"] == 6
    assert own["causal"] is False and own["projector_type"] == "lilicorr" and own["lilicorr_enabled"] is True
    assert (own["mask_token_id"], own["target_layer_ids"]) == (16, [1, 4])
    assert {k: own[k] for k in FIELDS} == {
        "lilicorr_candidate_topk": 4, "lilicorr_hidden_size": width, "lilicorr_num_layers": 2,
        "lilicorr_num_heads": 4, "lilicorr_mlp_ratio": 2.0, "lilicorr_factor_dim": 16, "lilicorr_vector_eps": 1e-3,
        "lilicorr_logit_scale": 6.0}
    k = own["lilicorr_candidate_topk"]
    assert k <= 16 and k & (k - 1) == 0
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    head = {n: tuple(t.shape) for n, t in tensors.items() if n.startswith("lilicorr.")}
    assert head == expected_head(config)  # both ways: nothing missing, nothing surplus
    assert not any(n.startswith(("embed_tokens", "lm_head")) for n in tensors)
    # the candidate path and the walk from the file's tensors, on a random block
    g = torch.Generator().manual_seed(2)
    context = torch.randn(1, 10, 128, generator=g)
    block = torch.tensor([[11, 16, 16, 16, 16, 16]])
    embed, lm_head = target.get_input_embeddings(), target.get_output_embeddings()
    ours = load_drafter(out)
    positions = torch.arange(0, 16).view(1, -1)
    with torch.no_grad():
        hidden = ours(context, ours.embed_block(embed, block), positions, sdpa_attention, None)
        drafts = ours.draft(hidden, lm_head, block[:, 0])[0][0].tolist()
        slots = hidden[0, 1:]
        lp, cand = torch.log_softmax(slots @ lm_head.weight.T, -1).topk(k, -1)
        rms = tensors["hidden_norm.weight"]
        row = context[0, 9] @ tensors["fc.weight"].T
        row = row * torch.rsqrt((row * row).mean() + config["rms_norm_eps"]) * rms
        plain = {n[len("lilicorr."):]: t for n, t in tensors.items() if n.startswith("lilicorr.")}
        start, pair = head_scores({n: t.double() for n, t in plain.items()}, own, config["hidden_size"],
                                  config["rms_norm_eps"], embed(cand).double(), slots.double(), lp.double(),
                                  row.double(), 1.0)
    assert drafts == [int(cand[s, r]) for s, r in enumerate(walk(start, pair))]


def test_the_export_reloads_and_one_without_a_head_field_is_refused(target, tmp_path):
    d, out = exported(target, tmp_path / "E")
    config = json.loads((out / "config.json").read_text())
    assert architecture_of_export(config).name == "lilicorr"
    back = load_drafter(out)
    assert type(back) is type(d) and back.state_dict().keys() == d.state_dict().keys()
    assert all(torch.equal(back.state_dict()[k], t) for k, t in d.state_dict().items())
    for field in ("lilicorr_logit_scale", "lilicorr_candidate_topk"):
        broken = {**config, "dflash_config": {k: v for k, v in config["dflash_config"].items() if k != field}}
        (out / "config.json").write_text(json.dumps(broken))
        with pytest.raises(ValueError, match=field):
            load_drafter(out)
    (out / "config.json").write_text(json.dumps({**config, "dflash_config": {**config["dflash_config"],
                                                                          "lilicorr_candidate_topk": 12}}))
    with pytest.raises(ValueError, match="power of two"):
        load_drafter(out)
