"""DSpark: the anchor-as-first block layout, the objective against a dense float64 reference (value and gradients),
its config section, lossless decoding with the sequential Markov correction, the flat export, and a real run."""

from __future__ import annotations

import json
import logging
import math

import pytest
import torch
import yaml
from safetensors import safe_open

from dflash_train.architectures.attention import sdpa_attention
from dflash_train.architectures.family.backend import resolve_backend
from dflash_train.architectures.family.config import make_drafter_config
from dflash_train.architectures.family.mask import dense_mask
from dflash_train.architectures.dspark.blocks import plan
from dflash_train.architectures.dspark.loss import chunked_dspark_rows, target_positions
from dflash_train.architectures.dspark.model import DSparkDrafter
from dflash_train.architectures.dspark.objective import DSparkObjective, rows_by_position
from dflash_train.architectures.io import load_drafter, save_drafter
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


def reference_slot_weights(q: list, mode: str, floor: float, alpha: float) -> list:
    """Weights of a block's counted slots (in order) from the drafter's label probabilities `q`, by brute force:
    acceptance max(prod_{j<k} q_j, floor); dpace sum_{m>=j} prod_{i<=m} ((1 - alpha) q_i + alpha)."""
    if mode == "acceptance":
        return [max(float(torch.tensor(q[:k], dtype=torch.float64).prod()), floor) for k in range(len(q))]
    prefix = [float(torch.tensor([(1 - alpha) * x + alpha for x in q[:m + 1]], dtype=torch.float64).prod())
              for m in range(len(q))]
    return [sum(prefix[j:]) for j in range(len(q))]


def dense_reference(d, target_model, capture, ids, loss_mask, lengths, weights_cfg, mode="decay", floor=0.05,
                    alpha=0.5):
    """The loss in float64 from full logits: CE, full L1 and confidence BCE with the detached acceptance label;
    CE and L1 weighted by the decay or (`mode`) DFlash's acceptance / dpace weights, the BCE by the decay."""
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
    main, bce, main_wsum, decay_wsum = 0.0, 0.0, 0.0, 0.0
    for r in range(ids.shape[0]):
        for j in range(labels.shape[1]):
            state = None
            terms, decays, q = [], [], []  # the block's counted slots
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
                terms.append(ce_w * ce + l1_w * l1)
                decays.append(w)
                q.append(float(p[labels[r, j, k]].detach()))
                if d.with_confidence:
                    c = (1 - l1.detach() / 2).clamp(0, 1)
                    x = torch.cat([hk, e]) if d.confidence_with_markov else hk
                    logit = d.confidence_head.proj(x)[0]
                    bce = bce + w * torch.nn.functional.binary_cross_entropy_with_logits(logit, c)
                decay_wsum += w
            slot_w = decays if mode == "decay" else reference_slot_weights(q, mode, floor, alpha)
            for w, term in zip(slot_w, terms):
                main = main + w * term
                main_wsum += w
    return main / main_wsum + conf_w * bce / decay_wsum


def assert_same_loss_and_gradients(d, loss: torch.Tensor, ref: torch.Tensor) -> dict:
    """`loss` equals the float64 reference `ref`, and so does every trainable parameter's gradient; returns the
    gradients by parameter name."""
    named = [(n, p) for n, p in d.named_parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, [p for _, p in named], allow_unused=True)
    ref_grads = torch.autograd.grad(ref, [p for _, p in named], allow_unused=True)
    torch.testing.assert_close(loss, ref, rtol=1e-7, atol=1e-9)  # the capture's final state: 1e-9 apart
    for (n, _), a, b in zip(named, grads, ref_grads):
        if b is None:
            assert a is None or not a.abs().any(), n
            continue
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-8, msg=n)
    return {n: g for (n, _), g in zip(named, grads)}


def objective_on_a_fixed_batch(d, capture, cfg):
    """(ids, loss mask, lengths, stats) of DSpark's objective in float64 on one fixed two-row batch."""
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(3, 400, (2, 30), generator=g)
    loss_mask = (torch.rand(2, 30, generator=g) < 0.85).long()
    lengths = torch.tensor([30, 22])
    objective = DSparkObjective(d, capture, resolve_backend("sdpa", torch.device("cpu"), BS), cfg, torch.float64)
    return ids, loss_mask, lengths, objective(Batch(ids, loss_mask, lengths), torch.Generator().manual_seed(7))


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
        ids, loss_mask, lengths, stats = objective_on_a_fixed_batch(d, capture, cfg)
        ref = dense_reference(d, target, capture, ids, loss_mask, lengths, weights)
        grads = assert_same_loss_and_gradients(d, stats.loss, ref)
        if rank:
            assert grads["markov_head.markov_w2.weight"].abs().sum() > 0
        if confidence:
            assert grads["confidence_head.proj.weight"].abs().sum() > 0
    finally:
        target.float()


@pytest.mark.parametrize("mode", ["acceptance", "dpace"])
def test_dflash_slot_weights_on_dsparks_terms_equal_a_dense_float64_reference(target, mode):
    """`dspark.slot_weights` acceptance / dpace: CE and L1 weighted as DFlash weighs its slots, from the drafter's
    detached Markov-corrected label probabilities (brute-force products here); the confidence BCE keeps the decay."""
    d = dspark(target, "rnn", 8, True, True).double().train()
    capture = TargetCapture.from_model(target.double(), [1, 4])
    try:
        weights = (0.3, 0.7, 0.5, 3.0)
        cfg = config_from_dict({"drafter": {"architecture": "dspark", "block_size": BS, "num_draft_layers": 2},
                                "dspark": {"markov_rank": 8, "markov_head_type": "rnn", "slot_weights": mode,
                                           "ce_weight": weights[0], "l1_weight": weights[1],
                                           "confidence_weight": weights[2], "decay_gamma": weights[3]},
                                "objective": {"max_anchors": 6, "loss_chunk_size": 5, "acceptance_floor": 0.2,
                                              "dpace_alpha": 0.3},
                                "data": {"max_length": 64, "token_budget": 256}})
        ids, loss_mask, lengths, stats = objective_on_a_fixed_batch(d, capture, cfg)
        ref = dense_reference(d, target, capture, ids, loss_mask, lengths, weights, mode, floor=0.2, alpha=0.3)
        decayed = dense_reference(d, target, capture, ids, loss_mask, lengths, weights)
        assert abs(float(ref) - float(decayed)) > 1e-3  # the weighting matters on this batch
        assert_same_loss_and_gradients(d, stats.loss, ref)
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


def _run_config(tmp_path, tiny_target_dir, counting_jsonl):
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
    return tmp_path / "c.yaml"


def _losses(run):
    return {r["step"]: r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
            if "loss" in r}


def test_a_dspark_run_trains_exports_reloads_and_evaluates_losslessly(tiny_target_dir, counting_jsonl, tmp_path,
                                                                      caplog):
    from dflash_train.cli import main

    whole = tmp_path / "whole"
    with caplog.at_level(logging.INFO, logger="dflash_train"):
        assert main(["train", str(_run_config(tmp_path, tiny_target_dir, counting_jsonl)), "--run-dir", str(whole),
                     "--max-steps", "4"]) == 0
    assert sorted(_losses(whole)) == [1, 2, 3, 4]
    rec = [json.loads(x) for x in (whole / "metrics.jsonl").read_text().splitlines()]
    assert all("confidence_loss" in r and "l1_loss" in r for r in rec if "loss" in r)
    train_log = (whole / "train.log").read_text()  # what it optimised, and that DFlash's slot weighting is not it
    assert ("objective (dspark): 0.1 x CE + 0.9 x L1 to the target's distribution, slots weighted exp(-k / 4); + 1 x "
            "confidence BCE") in train_log and "objective.slot_weighting and objective.gamma do not apply" in train_log
    assert json.loads((whole / "export" / "config.json").read_text())["architectures"] == ["Qwen3DSparkModel"]
    assert type(load_drafter(whole / "export")) is DSparkDrafter
    out = tmp_path / "eval.json"
    assert main(["eval", "--target", str(tiny_target_dir), "--drafter", str(whole / "export"), "--data",
                 str(counting_jsonl), "--limit", "2", "--max-new-tokens", "8", "--out", str(out), "--no-progress",
                 "--device", "cpu"]) == 0
    body = json.loads(out.read_text())["datasets"][str(counting_jsonl)]
    assert body["modes"]["block"]["tau"] >= 1 and body["lossless_mismatches"] == []


def test_a_dspark_run_with_dflashs_acceptance_weights_trains_and_says_so(tiny_target_dir, counting_jsonl, tmp_path,
                                                                         caplog):
    from dflash_train.cli import main

    with caplog.at_level(logging.INFO, logger="dflash_train"):
        assert main(["train", str(_run_config(tmp_path, tiny_target_dir, counting_jsonl)),
                     "dspark.slot_weights=acceptance", "--run-dir", str(tmp_path / "R"), "--max-steps", "2"]) == 0
    losses = _losses(tmp_path / "R")
    assert sorted(losses) == [1, 2] and all(math.isfinite(v) for v in losses.values())
    assert ("slots weighted as objective.slot_weighting acceptance weighs DFlash's (dspark.slot_weights)"
            in (tmp_path / "R" / "train.log").read_text())


@pytest.mark.long  # the run above again, and one stopped at step 2 and resumed
def test_a_dspark_run_resumes_exactly(tiny_target_dir, counting_jsonl, tmp_path):
    from dflash_train.cli import main

    cfg = _run_config(tmp_path, tiny_target_dir, counting_jsonl)
    whole, part = tmp_path / "whole", tmp_path / "part"
    assert main(["train", str(cfg), "--run-dir", str(whole), "--max-steps", "4"]) == 0
    assert main(["train", str(cfg), "--run-dir", str(part), "--max-steps", "2"]) == 0
    assert main(["train", str(cfg), "--run-dir", str(part), "--max-steps", "4", "--resume"]) == 0
    assert sorted(_losses(whole)) == [1, 2, 3, 4] and _losses(part) == _losses(whole)


def confident(target, seed=0) -> DSparkDrafter:
    """A drafter whose confidence varies from slot to slot (the tiny head's random start is ~0.5 everywhere)."""
    d = dspark(target, seed=seed)
    with torch.no_grad():
        d.confidence_head.proj.weight.normal_(0, 1.0)
        d.confidence_head.proj.bias.fill_(0.3)
    return d


def test_every_slot_drafts_and_confidence_truncation_stays_lossless_and_verifies_fewer(target):
    """Greedy block decoding in float32 drafts all bs slots (bs + 1 tokens verified per step without a threshold);
    with `confidence_threshold` each step verifies the drafts before the first below it, its output still the
    target's own greedy output, with fewer tokens verified per step; a drafter sure of nothing verifies the anchor
    alone."""
    d = confident(target)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 49152, (n,), generator=g).tolist() for n in (6, 19)]
    full = SpeculativeDecoder(target, d, stop_token_ids=[2])
    cut = SpeculativeDecoder(target, d, stop_token_ids=[2], confidence_threshold=0.5)
    doubtful = confident(target)
    with torch.no_grad():
        doubtful.confidence_head.proj.bias.fill_(-1e4)  # every slot predicted rejected
    never = SpeculativeDecoder(target, doubtful, stop_token_ids=[2], confidence_threshold=0.5)
    verified = {"full": [], "cut": []}
    for prompt in prompts:
        ref = full.generate_target_only(prompt, 24).tokens
        a, b, c = full.generate_block(prompt, 24), cut.generate_block(prompt, 24), never.generate_block(prompt, 24)
        assert a.tokens == b.tokens == c.tokens == ref
        assert set(a.verified_lengths) == {BS + 1}
        assert set(c.verified_lengths) == {1} and c.tau == 1.0
        assert all(1 <= n <= v for n, v in zip(b.accept_lengths, b.verified_lengths))
        verified["full"] += a.verified_lengths
        verified["cut"] += b.verified_lengths
    mean = {k: sum(v) / len(v) for k, v in verified.items()}
    assert mean["cut"] < mean["full"] and len(set(verified["cut"])) > 1  # it truncates, and not always alike


def test_the_truncation_reads_the_drafters_confidence_of_each_drafted_token(target):
    """`draft_with_confidence`: slot k's confidence is sigmoid of the head on its state and the token drafted at
    slot k - 1 (the anchor for k = 0), the drafter's own: what the decoder truncates on."""
    d = confident(target)
    hidden = torch.randn(2, BS, target.config.hidden_size) * 0.05
    anchors = torch.tensor([5, 300])
    drafts, _, conf = d.draft_with_confidence(hidden, target.lm_head, anchors)
    assert drafts.shape == conf.shape == (2, BS)
    prev = torch.cat([anchors.view(-1, 1), drafts[:, :-1]], 1)
    x = torch.cat([hidden, d.markov_head.markov_w1(prev)], -1)
    torch.testing.assert_close(conf, torch.sigmoid(d.confidence_head.proj(x).squeeze(-1)))
    from dflash_train.architectures.dflash.model import DFlashDrafter

    plain = DFlashDrafter(make_drafter_config(target.config, num_draft_layers=1, block_size=BS,
                                              target_layer_ids=[1, 4], mask_token_id=16))
    assert not plain.has_confidence and plain.num_drafts() == BS - 1 and d.num_drafts() == BS
    with pytest.raises(ValueError, match="needs a drafter with a confidence head; this dflash drafter has none: drop --confidence-threshold"):
        SpeculativeDecoder(target, plain, confidence_threshold=0.5)
    with pytest.raises(ValueError, match="this dspark drafter has none"):
        SpeculativeDecoder(target, dspark(target, confidence=False, with_markov=False), confidence_threshold=0.5)
    for no_head in (plain, dspark(target, confidence=False, with_markov=False)):  # called directly: the same
        with pytest.raises(ValueError, match="--confidence-threshold: .* no confidence head"):
            no_head.draft_with_confidence(hidden, target.lm_head, anchors)


def small_vocab_pair(vocab=8, seed=0):
    """A 2-layer random target over `vocab` tokens and a DSpark drafter (block 3) with a strong Markov bias: their
    distributions differ, so speculative sampling must correct the drafts."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    tcfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=64,
                       tie_word_embeddings=True, initializer_range=0.15)
    small = LlamaForCausalLM(tcfg).eval()
    cfg = make_drafter_config(small.config, num_draft_layers=1, block_size=3, target_layer_ids=[0, 1],
                              mask_token_id=vocab - 1)
    cfg.architectures = ["Qwen3DSparkModel"]
    cfg.markov_rank, cfg.markov_head_type = 4, "vanilla"
    cfg.enable_confidence_head, cfg.confidence_head_with_markov = True, True
    d = DSparkDrafter(cfg)
    with torch.no_grad():
        d.markov_head.markov_w1.weight.normal_(0, 1.0)
        d.markov_head.markov_w2.weight.normal_(0, 1.0)
    return small, d.eval()


@pytest.mark.long  # a statistical test over 1,500 decodings (one to four minutes on 2 cores)
def test_sampled_decoding_follows_the_targets_distribution(target):
    """Speculative sampling with DSpark's Markov-corrected, sequentially drawn drafts is exact: over many runs the
    2nd and 3rd tokens (decided by the first and second verification steps) follow the target's own sampling
    distribution (exact marginals by enumeration; chi-square at p = 0.001), while drafts are accepted often."""
    small, d = small_vocab_pair()
    v, temperature, trials = 8, 1.0, 1500
    prompt = [1, 4, 2]
    with torch.no_grad():
        p1 = torch.softmax(small(torch.tensor([prompt])).logits[0, -1].double() / temperature, -1)
        seqs = torch.tensor([prompt + [a] for a in range(v)])
        p2 = torch.softmax(small(seqs).logits[:, -1].double() / temperature, -1)  # [t1, t2]
        seqs3 = torch.tensor([prompt + [a, b] for a in range(v) for b in range(v)])
        p3 = torch.softmax(small(seqs3).logits[:, -1].double() / temperature, -1).view(v, v, v)
    want2 = p1 @ p2
    want3 = torch.einsum("a,ab,abc->c", p1, p2, p3)
    dec = SpeculativeDecoder(small, d, temperature=temperature, seed=3)
    counts2, counts3 = torch.zeros(v, dtype=torch.float64), torch.zeros(v, dtype=torch.float64)
    accepted = 0
    for _ in range(trials):
        out = dec.generate_block(prompt, 3)
        counts2[out.tokens[1]] += 1
        counts3[out.tokens[2]] += 1
        accepted += out.accept_lengths[0] - 1
    for counts, want in ((counts2, want2), (counts3, want3)):
        expected = want * trials
        assert float(((counts - expected) ** 2 / expected).sum()) < 24.3  # chi-square, 7 dof, p = 0.001
    assert accepted > 0.3 * trials  # the drafts are not all rejected: the accept rule is exercised


def dense_dpard_reference(d, target_model, capture, ids, loss_mask, lengths, conf_w, gamma, alpha):
    """D-PARD in float64 from full logits, block by block: sum_t W_t R_t over the sequences, W_t the suffix sums of
    the prefix products of alpha + (1 - alpha) * acceptance (1 where a slot does not count), detached; plus the
    confidence BCE over the exp-decay weights."""
    blocks, _ = plan(ids, loss_mask, lengths, BS, 6, torch.Generator().manual_seed(7), 16, gamma)
    labels, prev, counted = brute_force_blocks(ids, loss_mask, lengths, blocks.anchors, blocks.keep)
    hidden = capture(ids)
    out = target_model.model(ids).last_hidden_state
    s = ids.shape[1]
    pos = torch.cat([torch.arange(s).expand(ids.shape[0], s), blocks.block_positions], 1)
    h = d(hidden, capture.embed_tokens(blocks.block_ids), pos, sdpa_attention,
          dense_mask(blocks.anchors, blocks.keep, s, BS)).view(*labels.shape, -1)
    head = capture.lm_head.weight
    actor, conf, wsum = 0.0, 0.0, 0.0
    for r in range(ids.shape[0]):
        for j in range(labels.shape[1]):
            state, renyi, factor = None, [], []
            for k in range(BS):
                hk = h[r, j, k]
                f, e, state = d.markov_head.step(hk, prev[r, j, k], state)
                z = hk @ head.t() + d.markov_head.markov_w2.weight @ f
                if not counted[r, j, k]:
                    renyi.append(0.0)
                    factor.append(1.0)
                    continue
                a = int(blocks.anchors[r, j])
                p = torch.softmax(z, -1)
                pt = torch.softmax(out[r, a + k] @ head.t(), -1)
                renyi.append(-2 * torch.log(torch.sqrt(pt.detach() * p).sum()))
                acc = float((1 - (p - pt).abs().sum() / 2).clamp(0, 1))
                factor.append(alpha + (1 - alpha) * acc)
                w = float(torch.exp(torch.tensor(-k / gamma)))
                logit = d.confidence_head.proj(torch.cat([hk, e]))[0]
                conf = conf + w * torch.nn.functional.binary_cross_entropy_with_logits(
                    logit, torch.tensor(acc, dtype=logit.dtype))
                wsum += w
            prefix = [float(torch.tensor(factor[:k + 1], dtype=torch.float64).prod()) for k in range(BS)]
            for t in range(BS):
                if counted[r, j, t]:
                    actor = actor + sum(prefix[t:]) * renyi[t]
    return actor / ids.shape[0] + conf_w * conf / wsum


@pytest.mark.parametrize("kind", ["vanilla", "rnn"])
def test_dpard_equals_a_dense_float64_reference(target, kind):
    d = dspark(target, kind).double().train()
    capture = TargetCapture.from_model(target.double(), [1, 4])
    try:
        cfg = config_from_dict({"drafter": {"architecture": "dspark", "block_size": BS, "num_draft_layers": 2},
                                "dspark": {"markov_rank": 8, "markov_head_type": kind, "loss": "dpard",
                                           "ce_weight": 0, "l1_weight": 0, "confidence_weight": 0.5,
                                           "decay_gamma": 3.0, "dpard_alpha": 0.3},
                                "objective": {"max_anchors": 6, "loss_chunk_size": 5},
                                "data": {"max_length": 64, "token_budget": 256}})
        ids, loss_mask, lengths, stats = objective_on_a_fixed_batch(d, capture, cfg)
        assert "renyi_loss" in stats.extra
        ref = dense_dpard_reference(d, target, capture, ids, loss_mask, lengths, 0.5, 3.0, 0.3)
        assert_same_loss_and_gradients(d, stats.loss, ref)
    finally:
        target.float()


def test_dpard_options_are_checked_naming_their_keys():
    """`dspark.loss=dpard` alone trains D-PARD (the CE and L1 weights unset mean 0 there); a CE or L1 weight set
    beside it is refused; unset under the paper's loss, they are the reference's 0.1 and 0.9."""
    from dflash_train.architectures.dspark.options import loss_weights

    ok = {"drafter": {"architecture": "dspark"}}
    assert loss_weights(config_from_dict(ok).options) == (0.1, 0.9)
    assert loss_weights(config_from_dict({**ok, "dspark": {"l1_weight": 0.5}}).options) == (0.1, 0.5)
    alone = config_from_dict({**ok, "dspark": {"loss": "dpard"}}).options
    assert alone.loss == "dpard" and loss_weights(alone) == (0.0, 0.0)
    zeros = config_from_dict({**ok, "dspark": {"loss": "dpard", "ce_weight": 0, "l1_weight": 0}}).options
    assert loss_weights(zeros) == (0.0, 0.0)
    for extra in ({"ce_weight": 0.1}, {"l1_weight": 0.9}):
        with pytest.raises(ConfigError, match=r"'dspark.loss': dpard replaces the CE and L1 terms.*remove those keys"):
            config_from_dict({**ok, "dspark": {"loss": "dpard", **extra}})
    for alpha in (0, 1):
        with pytest.raises(ConfigError, match=r"'dspark.dpard_alpha'"):
            config_from_dict({**ok, "dspark": {"loss": "dpard", "ce_weight": 0, "l1_weight": 0, "dpard_alpha": alpha}})
    with pytest.raises(ConfigError, match=r"'dspark.slot_weights': acceptance weighs the CE and L1 terms, which "
                                          r"dspark.loss dpard replaces"):
        config_from_dict({**ok, "dspark": {"loss": "dpard", "slot_weights": "acceptance"}})
    with pytest.raises(ConfigError, match=r"'dspark.slot_weights'"):
        config_from_dict({**ok, "dspark": {"slot_weights": "gamma"}})


# ---------------------------------------------------------------------------------------------- the chunked loss


def loss_inputs(m: int, seed: int = 0, dtype=torch.float64, h: int = 12, v: int = 40, r: int = 5, seq: int = 9):
    """Rows of the chunked loss at random: hidden, feature, the frozen head, the Markov table, the target's final
    states `[2, seq, h]`, each row's flat position (sorted, rows sharing positions), labels, coefficients."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(m, h, generator=g, dtype=dtype).requires_grad_()
    feature = torch.randn(m, r, generator=g, dtype=dtype).requires_grad_()
    head = torch.randn(v, h, generator=g, dtype=dtype) * 0.7
    w2 = (torch.randn(v, r, generator=g, dtype=dtype) * 0.5).requires_grad_()
    final = torch.randn(2, seq, h, generator=g, dtype=dtype)
    source = torch.randint(0, 2 * seq, (m,), generator=g).sort().values
    labels = torch.randint(0, v, (m,), generator=g)
    coef = [torch.rand(m, generator=g, dtype=torch.float64) for _ in range(3)]
    return hidden, feature, head, w2, final, source, labels, coef


def dense_rows(hidden, feature, head, w2, target_rows, labels, a, b, c):
    """The chunked loss from full float64 logits: sum a CE + b L1 (+ c Renyi), and the per-row terms."""
    z = hidden @ head.t() + (feature @ w2.t() if feature is not None else 0)
    log_p, log_pt = torch.log_softmax(z, -1), torch.log_softmax(target_rows @ head.t(), -1)
    ce = -log_p.gather(1, labels.view(-1, 1)).squeeze(1)
    l1 = (log_p.exp() - log_pt.exp()).abs().sum(-1)
    renyi = -2 * torch.logsumexp((log_pt + log_p) / 2, -1)
    loss = (a * ce + b * l1).sum() + ((c * renyi).sum() if c is not None else 0)
    return loss, ce, l1, renyi, z.argmax(-1) == labels


@pytest.mark.parametrize("chunk,shuffled,markov,dpard", [(4, False, True, False), (4, True, True, True),
                                                          (7, False, False, True), (2048, True, True, False)])
def test_the_chunked_rows_equal_full_float64_logits_in_any_row_order(chunk, shuffled, markov, dpard):
    """`chunked_dspark_rows` against the loss from full logits, values and gradients (hidden, feature, Markov table):
    rows in position order (a chunk reads a short run of target states), or shuffled (a chunk's span is wide: still
    exact); the Markov bias inside the head's product or none; D-PARD's Renyi term or not."""
    hidden, feature, head, w2, final, source, labels, (a, b, c) = loss_inputs(23)
    if shuffled:
        order = torch.randperm(23, generator=torch.Generator().manual_seed(1))
        hidden, feature = hidden.detach()[order].requires_grad_(), feature.detach()[order].requires_grad_()
        source, labels, a, b, c = source[order], labels[order], a[order], b[order], c[order]
    feature, w2 = (feature, w2) if markov else (None, None)
    c = c if dpard else None
    targets = target_positions(final, source, chunk)
    got = chunked_dspark_rows(hidden, feature, head, w2, targets, labels, a, b, chunk, c)
    want = dense_rows(hidden, feature, head, w2, final.reshape(-1, final.shape[-1])[source], labels, a, b, c)
    params = [p for p in (hidden, feature, w2) if p is not None]
    for name, x, y in zip(("loss", "ce", "l1"), (got.loss, got.ce, got.l1), want[:3]):
        torch.testing.assert_close(x, y, rtol=1e-10, atol=1e-12, msg=name)
    if dpard:
        torch.testing.assert_close(got.renyi, want[3], rtol=1e-10, atol=1e-12)
    assert torch.equal(got.correct, want[4])
    for x, y in zip(torch.autograd.grad(got.loss, params), torch.autograd.grad(want[0], params)):
        torch.testing.assert_close(x, y, rtol=1e-9, atol=1e-12)


def test_rows_sharing_a_target_position_read_its_state_once():
    """`target_positions`: each position's state once, each row pointing at its own; per chunk the run of states its
    rows read, never a single state (a compiled variant of its own); `rows_by_position` sorts the counted rows by
    the position that predicted their label, which many rows share."""
    final = torch.randn(2, 30, 6, dtype=torch.float64)
    source = torch.tensor([3, 3, 4, 4, 4, 5, 31, 31, 40, 40, 40])
    targets = target_positions(final, source, 4)
    assert torch.equal(targets.states, final.reshape(60, 6)[[3, 4, 5, 31, 40]])
    assert torch.equal(targets.states[targets.where], final.reshape(60, 6)[source])
    # chunks [0, 4), [4, 8), [8, 11): states 0-1, 1-3, and 4 alone widened to 3-4
    assert targets.spans == [(0, 2), (1, 4), (3, 5)]

    g = torch.Generator().manual_seed(3)
    ids = torch.randint(20, 400, (2, 40), generator=g)
    loss_mask = torch.ones(2, 40, dtype=torch.long)
    blocks, _ = plan(ids, loss_mask, torch.tensor([40, 33]), BS, 12, g, 16, 4.0)
    idx, source = rows_by_position(blocks, 40)
    assert torch.equal(idx.sort().values, blocks.counted.view(-1).nonzero().squeeze(1))
    assert torch.equal(source, source.sort().values)
    n = blocks.anchors.shape[1]
    row, block, slot = idx // (n * BS), idx // BS % n, idx % BS
    assert torch.equal(source, row * 40 + blocks.anchors[row, block] + slot)  # label a + k + 1, read at a + k
    assert target_positions(torch.randn(2, 40, 6), source, 2048).states.shape[0] == source.unique().numel() < len(idx)


def test_dpard_compiles_each_chunk_function_once_without_a_recompile(monkeypatch):
    """D-PARD's step runs the chunk math twice: without the gradient (its slot weights), then with it. Each pass
    has a compiled function of its own, so neither is a second variant of the other: a D-PARD warm-up logs no
    recompile (Dynamo's eager backend on the CPU: the same tracing and guards as on CUDA)."""
    from dflash_train.accel import compile as compile_layer
    from dflash_train.architectures.dspark import loss as loss_mod

    monkeypatch.setattr(compile_layer, "_compiled", {})
    monkeypatch.setattr(compile_layer, "_codes", {})
    monkeypatch.setattr(loss_mod, "chunk_function", lambda name, fn, device, eager=None: compile_layer.compiled(
        f"test_{name}", fn, dynamic=True, backend="eager"))
    torch._dynamo.reset()
    try:
        hidden, feature, head, w2, final, source, labels, (a, b, c) = loss_inputs(12, 0, torch.float32)
        targets = target_positions(final, source, 5)
        with torch.no_grad():
            chunked_dspark_rows(hidden.detach(), feature.detach(), head, w2.detach(), targets, labels, a, b, 5, c)
        chunked_dspark_rows(hidden, feature, head, w2, targets, labels, a, b, 5, c).loss.backward()
        assert compile_layer.compiled_variants() == {"test_dspark_chunk_values": 1, "test_dspark_chunk": 1}
    finally:
        torch._dynamo.reset()


def test_the_chunk_math_compiles_one_graph_that_no_batch_recompiles(monkeypatch):
    """On CUDA the chunk's elementwise math compiles with dynamic rows and target states (Dynamo's eager backend on
    the CPU: the same tracing, one graph each with fullgraph, and the same guards): one graph for the loss with its
    gradient, one with D-PARD's Renyi term, one for D-PARD's gradient-free first pass; no other row count, chunk
    split or span of target states compiles another (no span of one state, no chunk of one row)."""
    from dflash_train.accel import compile as compile_layer
    from dflash_train.architectures.dspark import loss as loss_mod

    monkeypatch.setattr(compile_layer, "_compiled", {})
    monkeypatch.setattr(loss_mod, "chunk_function", lambda name, fn, device, eager=None: compile_layer.compiled(
        f"test_{name}", fn, dynamic=True, backend="eager"))
    torch._dynamo.reset()

    def run(m: int, chunk: int, seed: int) -> None:
        hidden, feature, head, w2, final, source, labels, (a, b, c) = loss_inputs(m, seed, torch.float32)
        targets = target_positions(final, source, chunk)
        chunked_dspark_rows(hidden, feature, head, w2, targets, labels, a, b, chunk).loss.backward()
        with torch.no_grad():
            chunked_dspark_rows(hidden.detach(), feature.detach(), head, w2.detach(), targets, labels, a * 0, b * 0,
                                chunk)
        chunked_dspark_rows(hidden, feature, head, w2, targets, labels, a * 0, b * 0, chunk, c).loss.backward()

    try:
        run(12, 5, 0)
        before = compile_layer.graphs_compiled()
        for m, chunk, seed in ((9, 4, 1), (19, 4, 2), (30, 7, 3), (5, 2048, 4), (2, 3, 5), (17, 8, 6)):
            run(m, chunk, seed)
        assert compile_layer.graphs_compiled() == before
    finally:
        torch._dynamo.reset()
