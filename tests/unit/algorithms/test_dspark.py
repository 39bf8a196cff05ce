"""DSpark: the anchor-as-first block layout, the objective against a dense float64 reference (value and gradients),
its config section, lossless decoding with the sequential Markov correction, the flat export, and a real run."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from safetensors import safe_open

from dflash_train.algorithms.base import sdpa_attention
from dflash_train.algorithms.dflash.attention import resolve_backend
from dflash_train.algorithms.dflash.config import make_drafter_config
from dflash_train.algorithms.dflash.mask import dense_mask
from dflash_train.algorithms.dspark.blocks import plan
from dflash_train.algorithms.dspark.model import DSparkDrafter
from dflash_train.algorithms.dspark.objective import DSparkObjective
from dflash_train.algorithms.io import load_drafter, save_drafter
from dflash_train.config.load import config_from_dict
from dflash_train.data.batch import Batch
from dflash_train.errors import ConfigError
from dflash_train.infer.spec_decode import SpeculativeDecoder
from dflash_train.target.capture import TargetCapture, load_target_model

BS = 4


@pytest.fixture(scope="module")
def target(tiny_target_dir):
    return load_target_model(tiny_target_dir, torch.float32, torch.device("cpu"))


def dspark(target, kind="vanilla", rank=8, confidence=True, with_markov=True, seed=0) -> DSparkDrafter:
    torch.manual_seed(seed)
    cfg = make_drafter_config(target.config, num_draft_layers=2, block_size=BS, target_layer_ids=[1, 4],
                              mask_token_id=16)
    cfg.architectures = ["Qwen3DSparkModel"]
    cfg.markov_rank, cfg.markov_head_type = rank, kind
    cfg.enable_confidence_head, cfg.confidence_head_with_markov = confidence, with_markov and rank > 0
    d = DSparkDrafter(cfg)
    with torch.no_grad():  # a visible Markov bias against the tiny model's logits
        if rank:
            d.markov_head.markov_w2.weight.normal_(0, 0.5)
    return d.eval()


def brute_force_blocks(ids, loss_mask, lengths, anchors, keep):
    """Slot k of the block at a: input the anchor (k = 0) or 16, label ids[a + k + 1], previous token ids[a + k],
    counted while every slot up to it is kept, in range and supervised."""
    b, n = anchors.shape
    labels = torch.zeros(b, n, BS, dtype=torch.long)
    prev = torch.zeros(b, n, BS, dtype=torch.long)
    counted = torch.zeros(b, n, BS, dtype=torch.bool)
    for r in range(b):
        for j in range(n):
            a = int(anchors[r, j])
            ok = bool(keep[r, j])
            for k in range(BS):
                p = a + k + 1
                ok = ok and p < int(lengths[r]) and bool(loss_mask[r, p])
                counted[r, j, k] = ok
                labels[r, j, k] = ids[r, min(p, ids.shape[1] - 1)]
                prev[r, j, k] = ids[r, min(a + k, ids.shape[1] - 1)]
    return labels, prev, counted


def test_blocks_are_anchor_as_first_with_a_cumulative_mask():
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(20, 400, (3, 40), generator=g)
    loss_mask = (torch.rand(3, 40, generator=g) < 0.75).long()
    lengths = torch.tensor([40, 31, 12])
    blocks, prev = plan(ids, loss_mask, lengths, BS, 8, torch.Generator().manual_seed(1), 16, 4.0)
    labels, want_prev, counted = brute_force_blocks(ids, loss_mask, lengths, blocks.anchors, blocks.keep)
    assert torch.equal(blocks.counted, counted) and counted.any() and (~counted[blocks.keep.unsqueeze(-1).expand_as(counted)]).any()
    assert torch.equal(blocks.labels[counted], labels[counted]) and torch.equal(prev[counted], want_prev[counted])
    for r in range(3):  # anchors: supervised with a supervised successor
        for a, kept in zip(blocks.anchors[r].tolist(), blocks.keep[r].tolist()):
            if kept:
                assert loss_mask[r, a] and loss_mask[r, a + 1] and a + 1 < lengths[r]
    ids_in = blocks.block_ids.view(3, -1, BS)
    assert torch.equal(ids_in[..., 0], torch.gather(ids, 1, blocks.anchors)) and (ids_in[..., 1:] == 16).all()
    assert torch.equal(blocks.block_positions.view(3, -1, BS), blocks.anchors.unsqueeze(-1) + torch.arange(BS))
    w = torch.exp(-torch.arange(BS) / 4.0)
    torch.testing.assert_close(blocks.weights, w * counted)


def dense_reference(d, target_model, capture, ids, loss_mask, lengths, weights_cfg):
    """The loss in float64 from full logits: CE, full L1 and confidence BCE with the detached acceptance label."""
    ce_w, l1_w, conf_w, gamma = weights_cfg
    blocks, _ = plan(ids, loss_mask, lengths, BS, 6, torch.Generator().manual_seed(7), 16, gamma)
    labels, prev, counted = brute_force_blocks(ids, loss_mask, lengths, blocks.anchors, blocks.keep)
    hidden = capture(ids)
    out = target_model.model(ids).last_hidden_state  # the target's final normed states
    embeds = capture.embed_tokens(blocks.block_ids)
    s = ids.shape[1]
    pos = torch.cat([torch.arange(s).expand(ids.shape[0], s), blocks.block_positions], 1)
    h = d(hidden, embeds, pos, sdpa_attention, dense_mask(blocks.anchors, blocks.keep, s, BS))
    h = h.view(*labels.shape, -1)
    head = capture.lm_head.weight
    total = 0.0
    wsum = 0.0
    for r in range(ids.shape[0]):
        for j in range(labels.shape[1]):
            state = None
            for k in range(BS):
                hk = h[r, j, k]
                z = hk @ head.t()
                e = None
                if d.markov_rank:
                    f, e, state = d.markov_head.step(hk, prev[r, j, k], state)
                    z = z + d.markov_head.markov_w2.weight @ f
                if not counted[r, j, k]:
                    continue
                a = int(blocks.anchors[r, j])
                p = torch.softmax(z, -1)
                pt = torch.softmax(out[r, a + k] @ head.t(), -1)
                ce = -torch.log_softmax(z, -1)[labels[r, j, k]]
                l1 = (p - pt).abs().sum()
                w = float(torch.exp(torch.tensor(-k / gamma)))
                term = ce_w * ce + l1_w * l1
                if d.with_confidence:
                    c = (1 - l1.detach() / 2).clamp(0, 1)
                    x = torch.cat([hk, e]) if d.confidence_with_markov else hk
                    logit = d.confidence_head.proj(x)[0]
                    term = term + conf_w * torch.nn.functional.binary_cross_entropy_with_logits(logit, c)
                total = total + w * term
                wsum += w
    return total / wsum


@pytest.mark.parametrize("kind,rank,confidence,with_markov", [
    ("vanilla", 8, True, True), ("gated", 8, True, False), ("rnn", 8, True, True), ("vanilla", 0, True, False),
    ("vanilla", 8, False, False)])
def test_the_objective_equals_a_dense_float64_reference(target, kind, rank, confidence, with_markov):
    d = dspark(target, kind, rank, confidence, with_markov).double().train()
    capture = TargetCapture.from_model(target.double(), [1, 4])
    try:
        weights = (0.3, 0.7, 0.5, 3.0)
        cfg = config_from_dict({"drafter": {"architecture": "dspark", "block_size": BS, "num_draft_layers": 2},
                                "dspark": {"markov_rank": rank, "markov_head_type": kind,
                                           "confidence_head": confidence, "confidence_head_with_markov": with_markov,
                                           "ce_weight": weights[0], "l1_weight": weights[1],
                                           "confidence_weight": weights[2] if confidence else 0.0,
                                           "decay_gamma": weights[3]},
                                "objective": {"max_anchors": 6, "loss_chunk_size": 5},
                                "data": {"max_length": 64, "token_budget": 256}})
        g = torch.Generator().manual_seed(5)
        ids = torch.randint(3, 400, (2, 30), generator=g)
        loss_mask = (torch.rand(2, 30, generator=g) < 0.85).long()
        lengths = torch.tensor([30, 22])
        objective = DSparkObjective(d, capture, resolve_backend("sdpa", torch.device("cpu"), BS), cfg, torch.float64)
        stats = objective(Batch(ids, loss_mask, lengths), torch.Generator().manual_seed(7))
        params = [p for p in d.parameters() if p.requires_grad]
        grads = torch.autograd.grad(stats.loss, params, allow_unused=True)
        ref = dense_reference(d, target, capture, ids, loss_mask, lengths, weights)
        ref_grads = torch.autograd.grad(ref, params, allow_unused=True)
        torch.testing.assert_close(stats.loss, ref, rtol=1e-7, atol=1e-9)  # the capture's final state: 1e-9 apart
        names = [n for n, _ in d.named_parameters() if _.requires_grad]
        for n, a, b in zip(names, grads, ref_grads):
            if b is None:
                assert a is None or not a.abs().any(), n
                continue
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-8, msg=n)
        if rank:
            assert grads[names.index("markov_head.markov_w2.weight")].abs().sum() > 0
        if confidence:
            assert grads[names.index("confidence_head.proj.weight")].abs().sum() > 0
    finally:
        target.float()


def test_the_section_is_checked_naming_its_keys():
    ok = {"drafter": {"architecture": "dspark"}}
    assert config_from_dict(ok).options.markov_rank == 256
    bad = [({"dspark": {"markov_rank": 0, "markov_head_type": "rnn"}}, r"'dspark.markov_head_type'"),
           ({"dspark": {"markov_rank": 0}}, r"'dspark.confidence_head_with_markov'"),
           ({"dspark": {"confidence_head": False}}, r"'dspark.confidence_weight'"),
           ({"dspark": {"ce_weight": 0, "l1_weight": 0}}, r"'dspark.ce_weight'"),
           ({"dspark": {"decay_gamma": 0}}, r"'dspark.decay_gamma'"),
           ({"dspark": {"markov_rank": -1}}, r"'dspark.markov_rank'"),
           ({"objective": {"distill_weight": 0.5}}, r"'objective.distill_weight'")]
    for extra, match in bad:
        with pytest.raises(ConfigError, match=match):
            config_from_dict({**ok, **extra})
    with pytest.raises(ConfigError, match=r"'dspark.markov_rank': applies to DSpark"):
        config_from_dict({"dspark": {"markov_rank": 8}})


@pytest.mark.parametrize("kind", ["vanilla", "gated", "rnn"])
def test_greedy_block_decoding_is_lossless(target, kind):
    dec = SpeculativeDecoder(target, dspark(target, kind), stop_token_ids=[2])
    g = torch.Generator().manual_seed(0)
    for n in (5, 17):
        prompt = torch.randint(3, 49152, (n,), generator=g).tolist()
        assert dec.generate_block(prompt, 24).tokens == dec.generate_target_only(prompt, 24).tokens


def test_drafts_follow_the_sequential_markov_correction(target):
    """Slot k's draft is the argmax of its base logits plus the bias of the token drafted at slot k - 1."""
    d = dspark(target)
    hidden = torch.randn(3, BS, target.config.hidden_size) * 0.05  # base logits the bias can outweigh
    anchors = torch.tensor([5, 77, 300])
    drafts, _ = d.draft(hidden, target.lm_head, anchors)
    prev = anchors
    for k in range(BS - 1):
        z = hidden[:, k] @ target.lm_head.weight.t() + d.markov_head.markov_w1(prev) @ d.markov_head.markov_w2.weight.t()
        assert torch.equal(drafts[:, k], z.argmax(-1))
        prev = drafts[:, k]
    unbiased = (hidden[:, :BS - 1] @ target.lm_head.weight.t()).argmax(-1)
    assert not torch.equal(drafts, unbiased)  # the correction matters here


def test_export_is_flat_with_the_engines_tensor_names_and_reloads(target, tmp_path):
    d = dspark(target, "vanilla")
    save_drafter(d, tmp_path / "E", dtype="float32")
    data = json.loads((tmp_path / "E" / "config.json").read_text())
    assert data["architectures"] == ["Qwen3DSparkModel"] and "dflash_config" not in data
    assert {k: data[k] for k in ("block_size", "mask_token_id", "target_layer_ids", "markov_rank", "markov_head_type",
                                 "enable_confidence_head", "confidence_head_with_markov")} == {
        "block_size": BS, "mask_token_id": 16, "target_layer_ids": [1, 4], "markov_rank": 8,
        "markov_head_type": "vanilla", "enable_confidence_head": True, "confidence_head_with_markov": True}
    with safe_open(str(tmp_path / "E" / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        w1, w2 = f.get_tensor("markov_head.markov_w1.weight"), f.get_tensor("markov_head.markov_w2.weight")
        conf = f.get_tensor("confidence_head.proj.weight")
    assert w1.shape == w2.shape == (target.config.vocab_size, 8) and conf.shape == (1, target.config.hidden_size + 8)
    assert "confidence_head.proj.bias" in keys and "fc.weight" in keys
    back = load_drafter(tmp_path / "E")
    assert type(back) is DSparkDrafter
    for (n, a), (_, b) in zip(d.state_dict().items(), back.state_dict().items()):
        assert torch.equal(a, b), n


@pytest.mark.long
def test_a_dspark_run_trains_resumes_exactly_exports_and_evaluates(tiny_target_dir, counting_jsonl, tmp_path):
    from dflash_train.cli import main

    cfg = {
        "target": {"path": str(tiny_target_dir)},
        "drafter": {"architecture": "dspark", "num_draft_layers": 1, "block_size": BS, "attention_backend": "sdpa"},
        "dspark": {"markov_rank": 8, "markov_head_type": "rnn"},
        "data": {"train_files": [str(counting_jsonl)], "max_length": 256, "token_budget": 512, "max_batch_size": 2},
        "objective": {"max_anchors": 16},
        # a constant rate: the schedule does not depend on the step cap, which differs between the two runs
        "optim": {"lr": 3e-3, "epochs": 10, "warmup_ratio": 0.0, "min_lr_ratio": 1.0},
        "run": {"device": "cpu", "log_every": 1, "save_every": 2, "progress_bar": False, "eval_every": 0,
                "export_dtype": "float32"},
    }
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    whole, part = tmp_path / "whole", tmp_path / "part"
    assert main(["train", str(tmp_path / "c.yaml"), "--run-dir", str(whole), "--max-steps", "4"]) == 0
    assert main(["train", str(tmp_path / "c.yaml"), "--run-dir", str(part), "--max-steps", "2"]) == 0
    assert main(["train", str(tmp_path / "c.yaml"), "--run-dir", str(part), "--max-steps", "4", "--resume"]) == 0

    def losses(run):
        return {r["step"]: r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
                if "loss" in r}

    assert sorted(losses(whole)) == [1, 2, 3, 4] and losses(part) == losses(whole)
    rec = [json.loads(x) for x in (whole / "metrics.jsonl").read_text().splitlines()]
    assert all("confidence_loss" in r and "l1_loss" in r for r in rec if "loss" in r)
    assert json.loads((whole / "export" / "config.json").read_text())["architectures"] == ["Qwen3DSparkModel"]
    out = tmp_path / "eval.json"
    assert main(["eval", "--target", str(tiny_target_dir), "--drafter", str(whole / "export"), "--data",
                 str(counting_jsonl), "--limit", "2", "--max-new-tokens", "8", "--out", str(out), "--no-progress",
                 "--device", "cpu"]) == 0
    body = json.loads(out.read_text())["datasets"][str(counting_jsonl)]
    assert body["modes"]["block"]["tau"] >= 1 and body["lossless_mismatches"] == []
