"""LiLiCorr: the head's parameter names and shapes, its init, the objective (the DFlash block loss plus the lattice's
CE, margin and target-penalty terms) against a float64 reference written out from the specification, gradients
included, its config section's checks, and a real training run whose loss falls."""

from __future__ import annotations

import json
import math

import pytest
import torch
import yaml

from _lilicorr_reference import head_scores

from dflash_train.architectures.attention import sdpa_attention
from dflash_train.architectures.family.backend import resolve_backend
from dflash_train.architectures.family.blocks import sample_anchors
from dflash_train.architectures.family.mask import dense_mask
from dflash_train.architectures.lilicorr.model import LiLiCorrDrafter
from dflash_train.architectures.lilicorr.objective import LiLiCorrObjective
from dflash_train.architectures import architecture
from dflash_train.architectures.io import load_drafter
from dflash_train.config.load import config_from_dict
from dflash_train.data.batch import Batch
from dflash_train.errors import ConfigError
from dflash_train.target.capture import TargetCapture, load_target_model

BLOCK = 4
MASK = 5


@pytest.fixture(scope="module")
def small_vocab_target(tmp_path_factory, tokenizer_dir):
    """A 4-layer random target over 24 tokens: an untrained drafter's top-8 or top-16 then often holds the gold,
    so the lattice terms have supervised slots."""
    from conftest import make_tiny_target

    path = make_tiny_target(tmp_path_factory.mktemp("lilicorr-target"), tokenizer_dir, layers=4, vocab_size=24)
    return load_target_model(path, torch.float32, torch.device("cpu"))


def run_cfg(topk=8, **section):
    return config_from_dict({"drafter": {"architecture": "lilicorr", "block_size": BLOCK, "num_draft_layers": 2},
                             "lilicorr": {"candidate_topk": topk, "head_hidden_size": 32, "head_num_layers": 2, "head_num_heads": 4,
                                          "mlp_ratio": 1.5, "factor_dim": 12, **section},
                             "objective": {"max_anchors": 12, "gamma": 3.0, "slot_weighting": "gamma"},
                             "data": {"max_length": 64, "token_budget": 256}})


def drafter_for(target, cfg, seed=0) -> LiLiCorrDrafter:
    torch.manual_seed(seed)
    arch = architecture("lilicorr")
    d = arch.drafter_class(arch.config_for_run(target.config, cfg, [1, 3], MASK))
    with torch.no_grad():  # a head away from its init: the embeddings and biases that start at 0 matter too
        for p in d.lilicorr.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return d


def test_the_head_has_the_engines_names_and_shapes_and_starts_as_specified(small_vocab_target):
    cfg = run_cfg()
    arch = architecture("lilicorr")
    torch.manual_seed(0)
    d = arch.drafter_class(arch.config_for_run(small_vocab_target.config, cfg, [1, 3], MASK))
    big, h, heads, f, k, s = 64, 32, 4, 12, 8, BLOCK - 1
    want = {"token_proj.weight": (h, big), "token_proj.bias": (h,), "pass_hidden_proj.weight": (h, big),
            "pass_hidden_proj.bias": (h,), "feature_mlp.0.weight": (5,), "feature_mlp.0.bias": (5,),
            "feature_mlp.1.weight": (h, 5), "feature_mlp.1.bias": (h,), "feature_mlp.3.weight": (h, h),
            "feature_mlp.3.bias": (h,), "slot_embedding": (1, 1, s, 1, h), "rank_embedding": (1, 1, 1, k, h),
            "relative_slot_bias": (heads, 2 * BLOCK - 1), "same_slot_bias": (heads,),
            "context_proj.weight": (h, big), "context_proj.bias": (h,), "output_norm.weight": (h,),
            "anchor_norm.weight": (h,), "factor_input_proj.weight": (h, 3 * h), "factor_input_proj.bias": (h,)}
    for name in ("out_head", "in_head", "anchor_out_head"):
        want.update({f"{name}.weight": (f, h), f"{name}.bias": (f,)})
    for i in range(2):
        want.update({f"layers.{i}.attn_norm.weight": (h,), f"layers.{i}.mlp_norm.weight": (h,),
                     f"layers.{i}.attn.in_proj_weight": (3 * h, h), f"layers.{i}.attn.in_proj_bias": (3 * h,),
                     f"layers.{i}.attn.out_proj.weight": (h, h), f"layers.{i}.attn.out_proj.bias": (h,),
                     f"layers.{i}.mlp.0.weight": (48, h), f"layers.{i}.mlp.0.bias": (48,),
                     f"layers.{i}.mlp.2.weight": (h, 48), f"layers.{i}.mlp.2.bias": (h,)})
    got = {n[len("lilicorr."):]: tuple(t.shape) for n, t in d.state_dict().items() if n.startswith("lilicorr.")}
    assert got == want
    t = {n: p for n, p in d.lilicorr.state_dict().items()}
    for name in ("slot_embedding", "rank_embedding", "relative_slot_bias", "same_slot_bias"):
        assert not t[name].any(), name
    for name in want:
        if name.endswith(".bias") and not name.startswith("feature_mlp.0"):
            assert not t[name].any(), name
    assert all(t[n].eq(1).all() for n in want if n.endswith("norm.weight") or n == "feature_mlp.0.weight")
    for name in ("out_head", "in_head", "anchor_out_head", "pass_hidden_proj", "layers.0.attn.out_proj"):
        assert 0.01 < float(t[name + ".weight"].std()) < 0.03, name  # N(0, initializer_range 0.02)
    bound = (6 / (h + 3 * h)) ** 0.5  # xavier-uniform of the packed [3h, h] projection
    assert float(t["layers.0.attn.in_proj_weight"].abs().max()) <= bound and \
        float(t["layers.0.attn.in_proj_weight"].abs().max()) > 0.8 * bound


def test_a_head_as_wide_as_the_drafter_has_no_token_projection(small_vocab_target):
    cfg = run_cfg(head_hidden_size=0)
    arch = architecture("lilicorr")
    d = arch.drafter_class(arch.config_for_run(small_vocab_target.config, cfg, [1, 3], MASK))
    names = set(d.state_dict())
    assert "lilicorr.pass_hidden_proj.weight" in names and not any(n.startswith("lilicorr.token_proj") for n in names)
    assert d.lilicorr.out_head.weight.shape == (12, 64)


# ---------------------------------------------------------------------------------------------------- the loss


def reference_loss(d, target, capture, ids, loss_mask, lengths, cfg):
    """The objective written out from the specification, block by block, in float64; with
    `lilicorr.backbone_gradient=false` the lattice terms read the backbone's outputs detached."""
    from dflash_train.architectures.lilicorr.options import loss_weights, options_of

    w_ce, w_margin, w_pen, margin = loss_weights(options_of(cfg))
    cut = (lambda t: t) if options_of(cfg).backbone_gradient else (lambda t: t.detach())
    k = options_of(cfg).candidate_topk
    anchors, keep = sample_anchors(loss_mask, lengths, BLOCK, cfg.objective.max_anchors, torch.Generator().manual_seed(7), 1)
    hidden = capture(ids)
    head = capture.lm_head.weight
    z_target = target(ids).logits  # the target's raw logits
    b, seq = ids.shape
    block_ids = torch.full((b, anchors.shape[1], BLOCK), MASK)
    block_ids[..., 0] = ids.gather(1, anchors)
    positions = (anchors.unsqueeze(-1) + torch.arange(BLOCK)).view(b, -1)
    pos = torch.cat([torch.arange(seq).expand(b, seq), positions], 1)
    packed = d(hidden, capture.embed_tokens(block_ids.view(b, -1)), pos, sdpa_attention,
               dense_mask(anchors, keep, seq, BLOCK)).view(b, anchors.shape[1], BLOCK, -1)
    tensors = {n: p for n, p in d.lilicorr.named_parameters()}
    fields = d.lilicorr.exported_fields()
    ce_sum = w_sum = 0.0
    lat_ce = lat_margin = lat_pen = supervised = 0.0
    for row in range(b):
        for n in range(anchors.shape[1]):
            if not keep[row, n]:
                continue
            a = int(anchors[row, n])
            counted = [a + j < int(lengths[row]) and bool(loss_mask[row, a + j]) for j in range(BLOCK)]
            logp = [torch.log_softmax(head @ packed[row, n, j], -1) for j in range(BLOCK)]
            for j in range(1, BLOCK):
                if counted[j]:
                    w = torch.exp(torch.tensor(-(j - 1) / 3.0)).double()
                    ce_sum, w_sum = ce_sum - w * logp[j][ids[row, a + j]], w_sum + w
            if not all(counted[1:]):
                continue
            lp, cand = zip(*[cut(logp[j]).topk(k) for j in range(1, BLOCK)])
            lp, cand = torch.stack(lp), torch.stack(cand)
            anchor = d.hidden_norm(d.fc(hidden[row, a - 1])) if a >= 1 else torch.zeros(64, dtype=torch.float64)
            log_start, log_pair = head_scores(tensors, fields, 64, d.config.rms_norm_eps,
                                              capture.embed_tokens(cand).detach(), cut(packed[row, n, 1:]), lp,
                                              cut(anchor), float(a >= 1))
            alive = 1.0
            for s in range(BLOCK - 1):
                gold = int(ids[row, a + s + 1])
                hits = (cand[s] == gold).nonzero()
                if not len(hits):
                    break
                g = int(hits[0])
                node = log_start if s == 0 else log_pair[s - 1][prev]
                logq = torch.log_softmax(node, -1)
                lat_ce = lat_ce - logq[g] * alive
                others = torch.cat([node[:g], node[g + 1:]])
                lat_margin = lat_margin + torch.relu(margin - (node[g] - others.max())) * alive
                zt = z_target[row, a + s, cand[s]].detach()
                lat_pen = lat_pen + (logq.exp() * torch.relu(zt[g] - zt)).sum() * alive
                supervised += 1
                prev = g
    l_dflash = ce_sum / (w_sum + 1e-6) if w_sum > 1 else 0.0
    denominator = max(1.0, supervised)
    loss = l_dflash + (w_ce * lat_ce + w_margin * lat_margin + w_pen * lat_pen) / denominator
    return loss, supervised


@pytest.mark.parametrize("topk,section,chunk", [
    (8, {}, 2048),
    pytest.param(16, {"w_ce": 0.125, "w_margin": 0.125, "w_pen": 0.25, "margin": 2.0}, 5,
                 marks=pytest.mark.long),  # ~18 s: k 16 in float64
    (4, {"w_ce": 1.0, "w_margin": 0.5, "w_pen": 0.0, "margin": 3.0}, 7),
    (8, {"backbone_gradient": False}, 2048)])
def test_the_objective_equals_the_specifications_loss_in_float64_with_gradients(small_vocab_target, topk, section,
                                                                                 chunk):
    cfg = run_cfg(topk, **section)
    cfg.objective.loss_chunk_size = chunk
    d = drafter_for(small_vocab_target, cfg).double().train()
    target = small_vocab_target.double()
    capture = TargetCapture.from_model(target, [1, 3])
    try:
        g = torch.Generator().manual_seed(5)
        ids = torch.randint(0, 24, (2, 30), generator=g)
        loss_mask = (torch.rand(2, 30, generator=g) < 0.95).long()
        lengths = torch.tensor([30, 22])
        objective = LiLiCorrObjective(d, capture, resolve_backend("sdpa", torch.device("cpu"), BLOCK), cfg,
                                      torch.float64)
        stats = objective(Batch(ids, loss_mask, lengths), torch.Generator().manual_seed(7))
        ref, supervised = reference_loss(d, target, capture, ids, loss_mask, lengths, cfg)
        assert supervised >= 4  # the lattice terms are exercised
        assert int(stats.extra["oracle_prefix"]) == supervised
        params = [(n, p) for n, p in d.named_parameters() if p.requires_grad]
        grads = torch.autograd.grad(stats.loss, [p for _, p in params], allow_unused=True)
        ref_grads = torch.autograd.grad(ref, [p for _, p in params], allow_unused=True)
        torch.testing.assert_close(stats.loss, ref, rtol=1e-10, atol=1e-12)
        for (name, p), a, b in zip(params, grads, ref_grads):
            a = torch.zeros_like(p) if a is None else a
            b = torch.zeros_like(p) if b is None else b
            torch.testing.assert_close(a, b, rtol=1e-7, atol=1e-10, msg=lambda m: f"{name}: {m}")
        by_name = dict(zip([n for n, _ in params], grads))
        trained = ["lilicorr.in_head.weight", "lilicorr.anchor_out_head.weight", "fc.weight", "layers.0.mlp.up_proj.weight"]
        if section.get("w_ce", 0.25) and topk == 16:  # chains past slot 0: the pair scores train
            trained.append("lilicorr.out_head.weight")
        assert all(by_name[n] is not None and by_name[n].abs().sum() > 0 for n in trained)
    finally:
        small_vocab_target.float()


# ---------------------------------------------------------------------------------------------------- the section


def test_the_section_defaults_to_the_shipped_recipe_and_refuses_bad_values_naming_the_key():
    cfg = config_from_dict({"drafter": {"architecture": "lilicorr"}})
    o = cfg.options
    assert (o.candidate_topk, o.head_hidden_size, o.head_num_layers, o.head_num_heads, o.mlp_ratio, o.factor_dim, o.vector_eps,
            o.logit_scale) == (8, 1024, 2, 8, 2.0, 1024, 1e-4, 8.0)
    assert cfg.objective.slot_weighting == "gamma" and cfg.objective.gamma == 7.0  # exp(-(k - 1) / 7)
    assert config_from_dict({}).objective.slot_weighting == "acceptance"  # DFlash's default is its own
    base = {"drafter": {"architecture": "lilicorr"}}
    refused = [
        ({"lilicorr": {"candidate_topk": 12}}, r"'lilicorr.candidate_topk': must be a power of two up to 16"),
        ({"lilicorr": {"candidate_topk": 32}}, r"'lilicorr.candidate_topk': must be a power of two up to 16"),
        ({"lilicorr": {"w_ce": 0.5}}, r"'lilicorr.w_margin': the loss keys .* set together or not at all"),
        ({"lilicorr": {"w_ce": 0, "w_margin": 0, "w_pen": 0, "margin": 1}}, r"'lilicorr.w_ce': .* all 0"),
        ({"lilicorr": {"w_ce": 0, "w_margin": 0.5, "w_pen": 0, "margin": 0}}, r"'lilicorr.margin': must be > 0"),
        ({"lilicorr": {"head_hidden_size": 100, "head_num_heads": 8}}, r"'lilicorr.head_num_heads'"),
        ({"drafter": {"architecture": "lilicorr", "draft_vocab_size": 100}}, r"'drafter.draft_vocab_size'"),
        ({"drafter": {"architecture": "lilicorr", "causal": True}}, r"'drafter.causal'"),
        ({"objective": {"distill_weight": 0.5}}, r"'objective.distill_weight'"),
        ({"parallel": {"placement": "split"}}, r"'parallel.placement': LiLiCorr's target penalty"),
    ]
    for extra, message in refused:
        with pytest.raises(ConfigError, match=message):
            config_from_dict({**base, **extra})
    for k in (1, 2, 4, 16):
        assert config_from_dict({**base, "lilicorr": {"candidate_topk": k}}).options.candidate_topk == k


# ---------------------------------------------------------------------------------------------------- a real run


def _run_config(tmp_path, tiny_target_dir, counting_jsonl):
    cfg = {
        "target": {"path": str(tiny_target_dir)},
        "drafter": {"architecture": "lilicorr", "num_draft_layers": 1, "block_size": 4, "attention_backend": "sdpa"},
        "lilicorr": {"candidate_topk": 4, "head_hidden_size": 16, "head_num_layers": 1, "head_num_heads": 2, "factor_dim": 8},
        "data": {"train_files": [str(counting_jsonl)], "max_length": 256, "token_budget": 512, "max_batch_size": 2},
        "objective": {"max_anchors": 16},
        "optim": {"lr": 3e-3, "epochs": 10, "warmup_ratio": 0.1, "max_steps": 12},
        "run": {"device": "cpu", "log_every": 1, "save_every": 100, "progress_bar": False, "eval_every": 0,
                "export_dtype": "float32"},
    }
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    return tmp_path / "c.yaml"


def test_a_lilicorr_run_learns_and_logs_the_lattice_terms(tiny_target_dir, counting_jsonl, tmp_path):
    from dflash_train.cli import main

    run = tmp_path / "run"
    assert main(["train", str(_run_config(tmp_path, tiny_target_dir, counting_jsonl)), "--run-dir", str(run)]) == 0
    steps = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    assert [r["step"] for r in steps] == list(range(1, 13))
    assert all("lattice_ce_loss" in r and "lattice_pen_loss" in r and "dflash_loss" in r for r in steps)
    first, last = sum(r["loss"] for r in steps[:3]) / 3, sum(r["loss"] for r in steps[-3:]) / 3
    assert last < 0.9 * first
    exported = json.loads((run / "export" / "config.json").read_text())
    assert exported["architectures"] == ["LiLiCorrDraftModel"]
    assert exported["dflash_config"]["lilicorr_candidate_topk"] == 4
    checkpoint = sorted((run / "checkpoints").glob("step-*"))[-1]
    again = tmp_path / "again"
    assert main(["export", str(checkpoint), "--out", str(again), "--dtype", "float32"]) == 0
    assert json.loads((again / "config.json").read_text())["dflash_config"] == exported["dflash_config"]
    first, second = load_drafter(run / "export"), load_drafter(again)
    assert all(torch.equal(t, second.state_dict()[k]) for k, t in first.state_dict().items())
    out = tmp_path / "eval.json"
    assert main(["eval", "--target", str(tiny_target_dir), "--drafter", str(again), "--data", str(counting_jsonl),
                 "--limit", "2", "--max-new-tokens", "8", "--out", str(out), "--no-progress", "--device", "cpu"]) == 0
    body = json.loads(out.read_text())["datasets"][str(counting_jsonl)]
    assert body["modes"]["block"]["tau"] >= 1 and body["lossless_mismatches"] == []


def test_a_block_without_an_anchor_row_conditions_on_nothing(small_vocab_target):
    """No row before the anchor (anchor 0): the anchor state is 0 whatever the row and context_proj's bias hold, as
    the specification's head computes it."""
    d = drafter_for(small_vocab_target, run_cfg()).double()
    g = torch.Generator().manual_seed(0)
    embeds = torch.randn(2, BLOCK - 1, 8, 64, generator=g, dtype=torch.float64)
    slots = torch.randn(2, BLOCK - 1, 64, generator=g, dtype=torch.float64)
    lp = torch.log_softmax(torch.randn(2, BLOCK - 1, 8, generator=g, dtype=torch.float64), -1).sort(-1, True).values
    anchor = torch.randn(2, 64, generator=g, dtype=torch.float64)
    valid = torch.tensor([True, False])
    start, pair = d.lilicorr(embeds, slots, lp, anchor, valid)
    tensors = dict(d.lilicorr.named_parameters())
    for i in range(2):
        ref_start, ref_pair = head_scores(tensors, d.lilicorr.exported_fields(), 64, d.config.rms_norm_eps,
                                          embeds[i], slots[i], lp[i], anchor[i], float(valid[i]))
        torch.testing.assert_close(start[i], ref_start)
        torch.testing.assert_close(pair[i], ref_pair)
    assert not torch.allclose(start[0], start[1])


@pytest.mark.long  # ~40 s: the run above again, and one in real processes killed and resumed
def test_a_lilicorr_run_killed_and_resumed_reaches_the_uninterrupted_losses(tiny_target_dir, counting_jsonl, tmp_path):
    """Through the CLI in real processes: a run SIGKILLed after its step-2 checkpoint, resumed with --resume, logs
    the losses of the run that was never stopped (the head's weights and optimizer state included)."""
    import signal

    from _harness import assert_same_losses, launch, losses, run, wait_until

    from dflash_train.cli import main

    cfg = _run_config(tmp_path, tiny_target_dir, counting_jsonl)
    every = ["run.save_every=2", "optim.max_steps=6"]
    whole, part, log = tmp_path / "whole", tmp_path / "part", tmp_path / "run.log"
    assert main(["train", str(cfg), *every, "--run-dir", str(whole)]) == 0
    proc = launch(["train", str(cfg), *every, "--run-dir", str(part)], log)
    try:
        wait_until(lambda: (part / "checkpoints" / "step-00000002" / "trainer_state.json").is_file(), proc, 300,
                   "the step-2 checkpoint")
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert run(["train", "--run-dir", str(part), "--resume"], log) == 0, log.read_text()[-3000:]
    assert_same_losses(losses(whole), losses(part), 6)


def test_under_bfloat16_autocast_the_scores_are_float32_and_the_losses_finite(small_vocab_target):
    cfg = run_cfg(8)
    d = drafter_for(small_vocab_target, cfg)
    capture = TargetCapture.from_model(small_vocab_target, [1, 3])
    ids = torch.randint(0, 24, (2, 30), generator=torch.Generator().manual_seed(5))
    batch = Batch(ids, torch.ones_like(ids), torch.tensor([30, 30]))
    losses = {}
    for dtype in (torch.float32, torch.bfloat16):
        objective = LiLiCorrObjective(d, capture, resolve_backend("sdpa", torch.device("cpu"), BLOCK), cfg, dtype)
        stats = objective(batch, torch.Generator().manual_seed(7))
        losses[dtype] = {k: float(v) for k, v in stats.extra.items() if k.endswith("_loss")}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        g = torch.Generator().manual_seed(0)
        start, pair = d.lilicorr(torch.randn(1, BLOCK - 1, 8, 64, generator=g), torch.randn(1, BLOCK - 1, 64, generator=g),
                                 torch.randn(1, BLOCK - 1, 8, generator=g), torch.randn(1, 64, generator=g),
                                 torch.tensor([True]))
    assert start.dtype == pair.dtype == torch.float32
    assert set(losses[torch.bfloat16]) == set(losses[torch.float32])
    assert all(math.isfinite(v) for v in losses[torch.bfloat16].values())


def test_a_training_step_runs_the_lattice_in_the_runs_chunks(small_vocab_target, monkeypatch):
    """The step's chunk is the run's (`head.chunk_blocks` of its largest micro-batch): with 2 rows of 12 blocks at
    most, a step's lattice takes at most MAX_CHUNKS chunks of one size; a run whose micro-batches may hold 8 rows
    takes larger chunks for the same batch (few chunks: the host's work per chunk stays behind the GPU's)."""
    from dflash_train.architectures.lilicorr import head as head_module
    from dflash_train.architectures.lilicorr import model as model_module

    monkeypatch.setattr(head_module, "CHUNK_NODES", 1)  # the least chunk: one block
    monkeypatch.setattr(head_module, "MAX_CHUNKS", 3)
    chunks: list[int] = []
    real = model_module.checkpoint

    def counting(fn, vectors, blocks, pass_hidden, *rest, **kw):
        chunks.append(pass_hidden.shape[0])
        return real(fn, vectors, blocks, pass_hidden, *rest, **kw)

    monkeypatch.setattr(model_module, "checkpoint", counting)
    capture = TargetCapture.from_model(small_vocab_target, [1, 3])
    ids = torch.randint(0, 24, (2, 30), generator=torch.Generator().manual_seed(5))
    batch = Batch(ids, torch.ones_like(ids), torch.tensor([30, 30]))
    steps = {}
    for rows in (2, 8):
        cfg = run_cfg(8)
        cfg.data.max_batch_size = rows
        objective = LiLiCorrObjective(drafter_for(small_vocab_target, cfg), capture,
                                      resolve_backend("sdpa", torch.device("cpu"), BLOCK), cfg, torch.float32)
        chunks.clear()
        objective(batch, torch.Generator().manual_seed(7)).loss.backward()
        steps[rows] = list(chunks)
    # 2 rows x 12 anchors: 24 blocks at most, chunks of 8; the batch's whole blocks (up to 24) take 3 at most
    assert 2 <= len(steps[2]) <= 3 and steps[2][0] == 8 and all(c == 8 for c in steps[2][:-1]), steps
    assert steps[8] == [sum(steps[2])], steps  # 8 rows: 96 blocks at most, chunks of 32: one for this batch


# aten ops whose result's size or value the host reads off the device: on a GPU, each waits for it
DEVICE_READS = {"nonzero", "_local_scalar_dense", "masked_select", "unique", "_unique2", "repeat_interleave"}


def test_the_step_after_planning_reads_nothing_off_the_device(small_vocab_target, monkeypatch):
    """The lattice's blocks and rows are planned on the host copy with the anchors (`LatticeBlocks`): the loss,
    from the drafter's output on, calls no op whose size or value the host must read off the device (on a GPU a
    wait that leaves the GPU idle while the host then launches the head's chunks)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class DeviceReads(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func._schema.name.split("::")[-1]
            if name in DEVICE_READS:
                self.seen.append(name)
            return func(*args, **(kwargs or {}))

    with DeviceReads() as control:
        torch.tensor([1, 0]).nonzero()
    assert control.seen == ["nonzero"]

    reads = DeviceReads()
    real = LiLiCorrObjective.lilicorr_loss

    def watched(self, *args):
        with reads:
            return real(self, *args)

    monkeypatch.setattr(LiLiCorrObjective, "lilicorr_loss", watched)
    cfg = run_cfg(8)
    objective = LiLiCorrObjective(drafter_for(small_vocab_target, cfg), TargetCapture.from_model(small_vocab_target, [1, 3]),
                                  resolve_backend("sdpa", torch.device("cpu"), BLOCK), cfg, torch.float32)
    ids = torch.randint(0, 24, (2, 30), generator=torch.Generator().manual_seed(5))
    lengths = torch.tensor([30, 22])
    loss_mask = (torch.arange(30) >= 6).long().expand(2, -1).clone()
    stats = objective(Batch(ids, loss_mask, lengths), torch.Generator().manual_seed(7))
    stats.loss.backward()
    assert torch.isfinite(stats.loss) and int(stats.extra["oracle_prefix"]) > 0
    assert reads.seen == [], f"the LiLiCorr loss read the device: {reads.seen}"


@pytest.mark.parametrize("grad", [True, False])
def test_a_micro_batch_without_a_whole_block_trains_the_block_loss_alone(small_vocab_target, grad):
    """Answers shorter than a block: no block has every drafted slot counted, so the lattice has no block. The step
    is the block loss alone (the lattice terms 0), and every head parameter still gets a gradient (zeros), as
    data-parallel ranks all-reducing the same parameters need."""
    cfg = run_cfg(8)
    d = drafter_for(small_vocab_target, cfg)
    objective = LiLiCorrObjective(d, TargetCapture.from_model(small_vocab_target, [1, 3]),
                                  resolve_backend("sdpa", torch.device("cpu"), BLOCK), cfg, torch.float32)
    ids = torch.randint(0, 24, (2, 30), generator=torch.Generator().manual_seed(5))
    loss_mask = torch.zeros(2, 30, dtype=torch.long)
    loss_mask[:, 10:13] = 1  # 3 supervised tokens: fewer than the block's 3 drafted slots after an anchor
    loss_mask[:, 20:23] = 1
    with torch.set_grad_enabled(grad):
        stats = objective(Batch(ids, loss_mask, torch.tensor([30, 30])), torch.Generator().manual_seed(7))
    assert int(stats.counted_per_slot.sum()) > 0
    assert float(stats.extra["lattice_ce_loss"]) == 0 and float(stats.extra["lattice_pen_loss"]) == 0
    assert float(stats.extra["oracle_prefix"]) == 0
    torch.testing.assert_close(stats.loss, stats.extra["dflash_loss"])
    if grad:
        stats.loss.backward()
        missing = [name for name, p in d.lilicorr.named_parameters() if p.grad is None]
        assert not missing, f"head parameters without a gradient: {missing}"
        assert all(float(p.grad.abs().sum()) == 0 for p in d.lilicorr.parameters())
