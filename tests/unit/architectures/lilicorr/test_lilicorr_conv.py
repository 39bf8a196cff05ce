"""LiLiCorr with `lilicorr.conv` ("+conv"): the family's grouped convolution around every backbone sublayer. The
config.json carries the two conv fields the engines build it from, and the export the conv tensors by the
specification's names and shapes (both ways); the untrained convolutions are the identity, so the drafter computes
what the plain one does until they train; decoding stays lossless; a real run trains them and exports; the step's
FLOPs and activation estimate count them (FLOPs checked against torch's own counter)."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from safetensors import safe_open
from torch.utils.flop_counter import FlopCounterMode

from dflash_train.architectures import architecture
from dflash_train.architectures.attention import sdpa_attention
from dflash_train.architectures.family.conv import BlockConv, ConvDecoderLayer
from dflash_train.architectures.family.layers import BlockDecoderLayer, RopeTables
from dflash_train.architectures.io import load_drafter, save_drafter
from dflash_train.architectures.stats import DraftWork
from dflash_train.config.load import config_from_dict
from dflash_train.errors import ConfigError
from dflash_train.infer.spec_decode import SpeculativeDecoder
from dflash_train.target.capture import load_target_model

HEAD = {"candidate_topk": 4, "head_hidden_size": 32, "head_num_layers": 1, "head_num_heads": 4, "factor_dim": 16}


@pytest.fixture(scope="module")
def target(tiny_target_dir):
    return load_target_model(tiny_target_dir, torch.float64, torch.device("cpu"))


def run_cfg(block_size=5, **section):
    return config_from_dict({"drafter": {"architecture": "lilicorr", "block_size": block_size, "num_draft_layers": 2},
                             "lilicorr": {**HEAD, **section}})


def build(target_config, cfg, seed=0):
    torch.manual_seed(seed)
    arch = architecture("lilicorr")
    return arch.drafter_class(arch.config_for_run(target_config, cfg, [1, 4], 16)).double().eval()


def perturb(modules, scale=0.3, seed=1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in modules:
            for p in m.parameters():
                p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * scale)


def convs(d):
    return [m for m in d.modules() if isinstance(m, BlockConv)]


def test_the_config_carries_the_conv_fields_and_bad_values_are_refused_naming_the_key(target):
    plain = build(target.config, run_cfg())
    assert "conv_kernel_size" not in plain.config.dflash_config and not convs(plain)
    d = build(target.config, run_cfg(conv=True, conv_kernel_size=3, conv_group_size=8))
    assert (d.config.dflash_config["conv_kernel_size"], d.config.dflash_config["conv_group_size"]) == (3, 8)
    assert all(type(layer) is ConvDecoderLayer for layer in d.layers) and len(convs(d)) == 4
    with pytest.raises(ConfigError, match=r"'lilicorr.conv_kernel_size': must be between 1 and drafter.block_size=5"):
        run_cfg(conv=True, conv_kernel_size=6)
    with pytest.raises(ConfigError, match=r"'lilicorr.conv_group_size': 24 does not divide the target's hidden size"):
        build(target.config, run_cfg(conv=True, conv_group_size=24))
    run_cfg(conv=False, conv_kernel_size=6)  # read only with conv


def test_untrained_convolutions_are_the_identity_and_trained_ones_change_the_drafts(target):
    plain = build(target.config, run_cfg())
    perturb([plain])  # a drafter far from its own init, the backbone and the head
    conv = build(target.config, run_cfg(conv=True))
    missing, unexpected = conv.load_state_dict(plain.state_dict(), strict=False)
    assert not unexpected and missing and all("_conv." in k for k in missing)
    g = torch.Generator().manual_seed(3)
    context = torch.randn(1, 9, 2 * target.config.hidden_size, generator=g, dtype=torch.float64)
    block = torch.tensor([[11, 16, 16, 16, 16]])
    embed, lm_head = target.get_input_embeddings(), target.get_output_embeddings()
    positions = torch.arange(0, 14).view(1, -1)

    def drafts(d):
        with torch.no_grad():
            hidden = d(context, d.embed_block(embed, block), positions, sdpa_attention, None)
            return hidden, d.draft(hidden, lm_head, block[:, 0])[0]

    (h_plain, d_plain), (h_conv, d_conv) = drafts(plain), drafts(conv)
    assert torch.equal(h_plain, h_conv) and torch.equal(d_plain, d_conv)
    perturb(convs(conv), scale=0.5)
    h_trained, _ = drafts(conv)
    assert (h_trained - h_plain).abs().max() > 1e-3


def test_greedy_decoding_with_the_convolutions_is_lossless(target):
    d = build(target.config, run_cfg(conv=True))
    perturb([d.lilicorr, *convs(d)])
    dec = SpeculativeDecoder(target, d, stop_token_ids=[2])
    g = torch.Generator().manual_seed(1)
    for n in (7, 19, 33):
        prompt = torch.randint(3, 49152, (n,), generator=g).tolist()
        assert dec.generate_block(prompt, 24).tokens == dec.generate_target_only(prompt, 24).tokens


def test_the_export_holds_the_conv_tensors_by_the_engines_names_and_reloads(target, tmp_path):
    d = build(target.config, run_cfg(conv=True, conv_kernel_size=2, conv_group_size=16)).float()
    perturb(convs(d))
    out = save_drafter(d, tmp_path / "E", dtype="float32")
    config = json.loads((out / "config.json").read_text())
    own, big = config["dflash_config"], config["hidden_size"]
    assert config["architectures"] == ["LiLiCorrDraftModel"] and own["projector_type"] == "lilicorr"
    assert (own["conv_kernel_size"], own["conv_group_size"]) == (2, 16)
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    k, groups = own["conv_kernel_size"], big // own["conv_group_size"]
    expected = {f"layers.{i}.{side}_conv.{name}": shape for i in range(config["num_hidden_layers"])
                for side in ("attention", "mlp")
                for name, shape in (("base_kernel", (2, k, big)), ("kernel_projection.weight", (2 * k * groups, big)))}
    assert {n: s for n, s in shapes.items() if "_conv." in n} == expected  # both ways
    back = load_drafter(out)
    assert all(torch.equal(back.state_dict()[n], t) for n, t in d.state_dict().items())
    broken = {**config, "dflash_config": {n: v for n, v in own.items() if n != "conv_group_size"}}
    (out / "config.json").write_text(json.dumps(broken))
    with pytest.raises(ValueError, match="needs both conv_kernel_size and conv_group_size"):
        load_drafter(out)


def test_the_step_flops_count_the_tap_projections_as_torch_counts_them(target):
    cfg = architecture("lilicorr").config_for_run(target.config, run_cfg(conv=True, conv_kernel_size=3), [1, 4], 16)
    plain_cfg = architecture("lilicorr").config_for_run(target.config, run_cfg(), [1, 4], 16)
    work = DraftWork(blocks=3, block_tokens=15, counted_rows=12)
    parts = architecture("lilicorr").step_flops(cfg).parts(work)
    assert "lilicorr_conv" not in architecture("lilicorr").step_flops(plain_cfg).parts(work)
    # torch's counter on one layer of each kind over the same 15 query rows, forward and backward
    rope = build(target.config, run_cfg()).rotary
    counted = {}
    for kind in (BlockDecoderLayer, ConvDecoderLayer):
        layer = kind(cfg).double()
        x = torch.randn(1, 15, cfg.hidden_size, dtype=torch.float64, requires_grad=True)
        context = torch.randn(1, 4, cfg.hidden_size, dtype=torch.float64)
        tables = RopeTables(*rope(torch.arange(4).view(1, -1), torch.float64),
                            *rope(torch.arange(4, 19).view(1, -1), torch.float64))
        with FlopCounterMode(display=False) as counter:
            layer(x, context, tables, sdpa_attention, None).sum().backward()
        counted[kind] = counter.get_total_flops()
    assert parts["lilicorr_conv"] == cfg.num_hidden_layers * (counted[ConvDecoderLayer] - counted[BlockDecoderLayer])
    memory = architecture("lilicorr").step_memory
    assert memory(cfg).layer_per_query(cfg.hidden_size) == (4 * 2 + 2) * cfg.hidden_size
    assert memory(plain_cfg).layer_per_query(cfg.hidden_size) == 0


def test_a_conv_run_trains_the_convolutions_and_exports_them(tiny_target_dir, counting_jsonl, tmp_path):
    from dflash_train.cli import main

    cfg = {
        "target": {"path": str(tiny_target_dir)},
        "drafter": {"architecture": "lilicorr", "num_draft_layers": 1, "block_size": 4, "attention_backend": "sdpa"},
        "lilicorr": {"candidate_topk": 4, "head_hidden_size": 16, "head_num_layers": 1, "head_num_heads": 2,
                     "factor_dim": 8, "conv": True},
        "data": {"train_files": [str(counting_jsonl)], "val_files": [str(counting_jsonl)], "max_length": 256,
                 "token_budget": 512, "max_batch_size": 2},
        "objective": {"max_anchors": 16},
        "optim": {"lr": 3e-3, "epochs": 10, "warmup_ratio": 0.1, "max_steps": 6},
        "run": {"device": "cpu", "log_every": 1, "save_every": 100, "progress_bar": False, "eval_every": 3,
                "export_dtype": "float32"},
    }
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    run = tmp_path / "run"
    assert main(["train", str(tmp_path / "c.yaml"), "--run-dir", str(run)]) == 0
    steps = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    assert len(steps) == 6 and all(r["loss"] == r["loss"] for r in steps)
    every = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in every if "val_loss" in r] == [3, 6]  # validation reads the target's final states too
    exported = load_drafter(run / "export")
    trained = [m for m in exported.modules() if isinstance(m, BlockConv)]
    assert len(trained) == 2 and all(m.kernel_projection.weight.abs().max() > 0 for m in trained)
