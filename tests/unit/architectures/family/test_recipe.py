"""Recipe options: acceptance-weighted slots, distillation from the target's logits, the
warmup-stable-decay schedule; D-PACE slot weights. Each against an independent dense float64
reference."""

import dataclasses
import json
import logging
import math

import pytest
import torch
import yaml

from dflash_train.config.load import config_from_dict
from dflash_train.architectures.family.blocks import build_blocks, dpace_weights, sample_anchors
from dflash_train.architectures.family.loss import CEOptions, chunked_weighted_ce
from dflash_train.architectures.family.objective import row_weights
from dflash_train.train.loop.step import lr_factor

F = torch.nn.functional


def _soft_ce_reference(hidden, weight, labels, weights, target_hidden=None, alpha=0.0, temperature=1.0):
    """Dense: full logits, q = (1 - alpha) onehot + alpha softmax(target logits / T), sum(w CE) / sum(w)."""
    logp = F.log_softmax(hidden @ weight.t(), -1)
    q = F.one_hot(labels, weight.shape[0]).to(logp.dtype)
    if target_hidden is not None:
        q = (1 - alpha) * q + alpha * F.softmax(target_hidden @ weight.t() / temperature, -1)
    ce = -(q * logp).sum(-1)
    return (weights * ce).sum() / weights.sum()


# ---------------------------------------------------------------------------- distillation, loss level


@pytest.mark.parametrize("alpha,temperature,chunk", [(0.0, 1.0, 7), (0.3, 0.7, 7), (0.3, 2.0, 1000), (1.0, 1.0, 5)])
def test_distill_loss_and_gradient_equal_a_dense_reference(alpha, temperature, chunk):
    g = torch.Generator().manual_seed(int(alpha * 10) + chunk)
    m, h, v = 29, 12, 40
    hidden = torch.randn(m, h, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(v, h, generator=g, dtype=torch.float64)
    target_hidden = torch.randn(m, h, generator=g, dtype=torch.float64)
    labels = torch.randint(0, v, (m,), generator=g)
    weights = torch.rand(m, generator=g, dtype=torch.float64) + 0.1
    out = chunked_weighted_ce(hidden, weight, labels, weights,
                              CEOptions(chunk, distill_weight=alpha, temperature=temperature), target_hidden)
    (grad,) = torch.autograd.grad(out.loss, hidden)
    ref_hidden = hidden.detach().clone().requires_grad_(True)
    ref = _soft_ce_reference(ref_hidden, weight, labels, weights, target_hidden, alpha, temperature)
    (ref_grad,) = torch.autograd.grad(ref, ref_hidden)
    torch.testing.assert_close(out.loss, ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-9, atol=1e-12)
    assert torch.equal(out.correct, (hidden @ weight.t()).argmax(-1) == labels)  # accuracy: the hard label


def test_distill_weight_zero_is_todays_loss_bit_for_bit():
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(17, 8, generator=g, requires_grad=True)
    weight, target_hidden = torch.randn(30, 8, generator=g), torch.randn(17, 8, generator=g)
    labels, weights = torch.randint(0, 30, (17,), generator=g), torch.rand(17, generator=g) + 0.1
    plain = chunked_weighted_ce(hidden, weight, labels, weights, CEOptions(4))
    mixed = chunked_weighted_ce(hidden, weight, labels, weights, CEOptions(4, distill_weight=0.0), target_hidden)
    assert torch.equal(plain.loss, mixed.loss)
    assert torch.equal(*(torch.autograd.grad(o.loss, hidden)[0] for o in (plain, mixed)))
    with pytest.raises(ValueError, match="target_hidden"):
        chunked_weighted_ce(hidden, weight, labels, weights, CEOptions(4, distill_weight=0.5))


# ---------------------------------------------------------------------------- acceptance weighting, loss level


def _blocks(seed, bs=5, seq=40, short=9):
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, 12, (2, seq), generator=g)
    loss_mask = (torch.rand(2, seq, generator=g) < 0.85).long()  # holes: uncounted slots inside blocks
    lengths = torch.tensor([seq, seq - short])
    anchors, keep = sample_anchors(loss_mask, lengths, bs, 6, g)
    return build_blocks(input_ids, loss_mask, lengths, anchors, keep, bs, 99, 3.0), g


def _brute_force_acceptance(logp, blocks, floor):
    """Loops: counted slot k weighs max(prod over counted j in 1..k-1 of p(label_j), floor)."""
    b, n, bs = blocks.counted.shape
    w = torch.zeros(b, n, bs, dtype=torch.float64)
    for i in range(b):
        for j in range(n):
            for k in range(1, bs):
                if blocks.counted[i, j, k]:
                    reach = 1.0
                    for t in range(1, k):
                        if blocks.counted[i, j, t]:
                            reach *= math.exp(float(logp[i, j, t, blocks.labels[i, j, t]]))
                    w[i, j, k] = max(reach, floor)
    return w


@pytest.mark.parametrize("chunk", [3, 1000])
def test_acceptance_weights_equal_a_brute_force_product_and_carry_no_gradient(chunk):
    floor = 0.02
    blocks, g = _blocks(chunk)
    v, h = 12, 6
    weight = torch.randn(v, h, generator=g, dtype=torch.float64)
    # Drafter outputs leaning towards their labels, so that products spread over (floor, 1].
    out = 0.8 * weight[blocks.labels].view(-1, h) + torch.randn(blocks.labels.numel(), h, generator=g, dtype=torch.float64)
    out.requires_grad_(True)
    cfg = config_from_dict({"objective": {"slot_weighting": "acceptance", "acceptance_floor": floor}})
    idx = blocks.counted.view(-1).nonzero().squeeze(1)
    res = chunked_weighted_ce(out[idx], weight, blocks.labels.view(-1)[idx], row_weights(cfg, blocks, idx),
                              CEOptions(chunk))
    (grad,) = torch.autograd.grad(res.loss, out)

    logp = F.log_softmax(out.detach() @ weight.t(), -1).view(*blocks.labels.shape, v)
    expect = _brute_force_acceptance(logp, blocks, floor)
    torch.testing.assert_close(res.weights, expect.view(-1)[idx], rtol=1e-10, atol=0)
    later = expect[..., 2:][blocks.counted[..., 2:]]
    assert (later == floor).any() and ((later > floor) & (later < 1)).any(), later  # both regimes exercised
    ref_out = out.detach().clone().requires_grad_(True)
    ref = _soft_ce_reference(ref_out[idx], weight, blocks.labels.view(-1)[idx], expect.view(-1)[idx])  # w constant
    (ref_grad,) = torch.autograd.grad(ref, ref_out)
    torch.testing.assert_close(res.loss, ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-9, atol=1e-12)


# ---------------------------------------------------------------------------- D-PACE weighting


def _brute_force_dpace(label_logp, counted, alpha):
    """Loops: counted slot j weighs the sum over counted m >= j of the product over counted i <= m of
    (1 - alpha) * p(label_i) + alpha. Uncounted slots are skipped outright (weight 0, in no sum or product)."""
    b, n, bs = counted.shape
    w = torch.zeros(b, n, bs, dtype=torch.float64)
    for r in range(b):
        for blk in range(n):
            for j in range(bs):
                if not counted[r, blk, j]:
                    continue
                total = 0.0
                for m in range(j, bs):
                    if not counted[r, blk, m]:
                        continue
                    reach = 1.0
                    for i in range(m + 1):
                        if counted[r, blk, i]:
                            reach *= (1 - alpha) * math.exp(float(label_logp[r, blk, i])) + alpha
                    total += reach
                w[r, blk, j] = total
    return w


def _dpace_case(seed):
    """Random label log-probs and a counted mask `[3, 5, 6]` holding every kind of uncounted slot: the anchor
    (slot 0), holes inside a block (loss mask), a row's tail past its end, a block with no counted slot, and
    blocks not kept. Uncounted entries hold random log-probs too: they must not matter."""
    g = torch.Generator().manual_seed(seed)
    b, n, bs = 3, 5, 6
    label_logp = torch.log(torch.rand(b, n, bs, generator=g, dtype=torch.float64).clamp_min(1e-3))
    counted = torch.rand(b, n, bs, generator=g) < 0.7
    counted[0, 0] = torch.tensor([False, True, False, True, True, False])  # a hole between counted slots
    counted[0, 2] = False  # a block with no counted slot
    counted[1, 4, 3:] = False  # the row ends inside its last block
    counted[2, 3:] = False  # blocks not kept
    counted[..., 0] = False  # the anchor never counts (as build_blocks gives it)
    return label_logp, counted


@pytest.mark.parametrize("seed,alpha", [(0, 0.5), (1, 0.5), (2, 0.0), (3, 0.2), (4, 0.9)])
def test_dpace_weights_equal_a_brute_force_sum_and_carry_no_gradient(seed, alpha):
    label_logp, counted = _dpace_case(seed)
    leaf = label_logp.clone().requires_grad_(True)
    w = dpace_weights(leaf, counted, alpha)
    assert not w.requires_grad and w.dtype == torch.float64
    expect = _brute_force_dpace(label_logp, counted, alpha)
    torch.testing.assert_close(w, expect, rtol=1e-12, atol=0)
    assert torch.equal(w != 0, counted)  # > 0 exactly on the counted slots (alpha = 0 too: every p > 0 here)
    # Uncounted slots' log-probs do not enter: the padding rows of a micro-batch read 0, anything else is equal.
    scrambled = torch.where(counted, label_logp, torch.randn_like(label_logp))
    assert torch.equal(dpace_weights(scrambled, counted, alpha), w)
    # The hand-set block [-, c, -, c, c, -]: w_1 = f1 + f1 f3 + f1 f3 f4, w_3 = f1 f3 + f1 f3 f4, w_4 = f1 f3 f4.
    f = (1 - alpha) * label_logp[0, 0].exp() + alpha
    p1, p3, p4 = f[1], f[1] * f[3], f[1] * f[3] * f[4]
    torch.testing.assert_close(w[0, 0], torch.stack([0 * p1, p1 + p3 + p4, 0 * p1, p3 + p4, p4, 0 * p1]),
                               rtol=1e-12, atol=0)


def test_dpace_alpha_one_counts_the_counted_slots_from_here_on():
    """alpha = 1: every factor is 1, so w_j = #{counted m >= j} (a suffix count), whatever the drafter predicts;
    a fully counted block of size bs weighs bs - j at slot j."""
    label_logp, counted = _dpace_case(5)
    w = dpace_weights(label_logp, counted, 1.0)
    suffix_count = counted.flip(-1).cumsum(-1).flip(-1).double() * counted
    assert torch.equal(w, suffix_count)
    full = torch.ones(1, 1, 6, dtype=torch.bool)
    full[..., 0] = False
    assert dpace_weights(torch.randn(1, 1, 6, dtype=torch.float64), full, 1.0).tolist() == [[[0, 5, 4, 3, 2, 1]]]


@pytest.mark.parametrize("chunk", [3, 1000])
def test_dpace_row_weights_in_the_loss_equal_the_brute_force_and_carry_no_gradient(chunk):
    blocks, g = _blocks(10 + chunk, short=31)  # the short row has at most 5 anchors of 6: blocks not kept
    v, h = 12, 6
    weight = torch.randn(v, h, generator=g, dtype=torch.float64)
    noise = torch.randn(blocks.labels.numel(), h, generator=g, dtype=torch.float64)
    out = 0.8 * weight[blocks.labels].view(-1, h) + noise  # leaning towards the labels: factors spread over (a, 1)
    out.requires_grad_(True)
    cfg = config_from_dict({"objective": {"slot_weighting": "dpace", "dpace_alpha": 0.3}})
    idx = blocks.counted.view(-1).nonzero().squeeze(1)
    res = chunked_weighted_ce(out[idx], weight, blocks.labels.view(-1)[idx], row_weights(cfg, blocks, idx),
                              CEOptions(chunk))
    (grad,) = torch.autograd.grad(res.loss, out)

    logp = F.log_softmax(out.detach() @ weight.t(), -1).view(*blocks.labels.shape, v)
    expect = _brute_force_dpace(logp.gather(-1, blocks.labels.unsqueeze(-1)).squeeze(-1), blocks.counted, 0.3)
    assert (~blocks.keep).any() and (blocks.keep.unsqueeze(-1) & ~blocks.counted)[..., 1:].any()  # both kinds met
    torch.testing.assert_close(res.weights, expect.view(-1)[idx], rtol=1e-10, atol=0)
    ref_out = out.detach().clone().requires_grad_(True)
    ref = _soft_ce_reference(ref_out[idx], weight, blocks.labels.view(-1)[idx], expect.view(-1)[idx])  # w constant
    (ref_grad,) = torch.autograd.grad(ref, ref_out)
    torch.testing.assert_close(res.loss, ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-9, atol=1e-12)


def test_gamma_weighting_is_the_decay():
    cfg = config_from_dict({}, ["objective.slot_weighting=gamma"])
    assert cfg.objective.distill_weight == 0.0
    blocks, _ = _blocks(0)
    idx = blocks.counted.view(-1).nonzero().squeeze(1)
    w = row_weights(cfg, blocks, idx)
    k = torch.arange(5).expand_as(blocks.labels).reshape(-1)[idx]
    torch.testing.assert_close(w, torch.exp(-(k - 1) / 3.0).float())


# ---------------------------------------------------------------------------- the whole objective on a tiny model


@pytest.fixture(scope="module")
def tiny64(tiny_target_dir):
    from dflash_train.target.capture import TargetCapture, load_target_model

    model = load_target_model(tiny_target_dir, torch.float64, torch.device("cpu"))
    return model, TargetCapture.from_model(model, [1, 3])


def test_capture_with_final_returns_what_feeds_the_lm_head(tiny64):
    model, target = tiny64
    ids = torch.randint(3, 49152, (2, 19), generator=torch.Generator().manual_seed(0))
    layers, final = target.capture(ids, with_final=True)
    with torch.no_grad():
        logits = model(ids).logits
    assert final.shape == (2, 19, 64)
    torch.testing.assert_close(target.lm_head(final), logits, rtol=1e-10, atol=1e-10)
    assert torch.equal(layers, target(ids)) and target.capture(ids)[1] is None


@pytest.mark.parametrize("objective", [
    {},
    {"slot_weighting": "acceptance", "acceptance_floor": 0.1},
    {"distill_weight": 0.3, "distill_temperature": 2.0},
    {"distill_weight": 1.0, "slot_weighting": "acceptance"},
    {"slot_weighting": "dpace"},
    {"slot_weighting": "dpace", "dpace_alpha": 0.2, "distill_weight": 0.3},
])
@pytest.mark.parametrize("context_multiple", [1, 16])
def test_forward_loss_equals_a_dense_reference(tiny64, objective, context_multiple):
    """The DFlash objective against full logits of the drafter and the target's own logits (HF forward):
    slot k of the block at a learns input_ids[a + k] and the target's distribution at a + k - 1.
    With the context padded to a multiple (as the flex backend pads it), nothing changes: the padded
    keys lie past every anchor."""
    from dflash_train.architectures.family.backend import resolve_backend
    from dflash_train.architectures.dflash.model import DFlashDrafter
    from dflash_train.architectures.family.config import make_drafter_config
    from dflash_train.data.batch import Batch
    from dflash_train.architectures.dflash.objective import DFlashObjective

    model, target = tiny64
    bs = 4
    cfg = config_from_dict({"drafter": {"block_size": bs, "num_draft_layers": 1},
                            "objective": {"max_anchors": 6, "gamma": 3.0, **objective},
                            "data": {"max_length": 64, "token_budget": 256}})
    torch.manual_seed(0)
    drafter = DFlashDrafter(make_drafter_config(model.config, num_draft_layers=1, block_size=bs,
                                                target_layer_ids=[1, 3], mask_token_id=16)).double()
    backend = dataclasses.replace(resolve_backend("sdpa", torch.device("cpu"), bs), context_multiple_of=context_multiple)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(3, 49152, (2, 30), generator=g)
    loss_mask = (torch.rand(2, 30, generator=g) < 0.8).long()
    batch = Batch(ids, loss_mask, torch.tensor([30, 22]))
    stats = DFlashObjective(drafter, target, backend, cfg, torch.float64)(batch, torch.Generator().manual_seed(7))
    grads = torch.autograd.grad(stats.loss, list(drafter.parameters()))

    # reference: the same anchors, the drafter's outputs, everything after them dense
    o = cfg.objective
    anchors, keep = sample_anchors(loss_mask, batch.lengths, bs, o.max_anchors, torch.Generator().manual_seed(7),
                                   backend.blocks_multiple_of)
    blocks = build_blocks(ids, loss_mask, batch.lengths, anchors, keep, bs, 16, o.gamma)
    position_ids = torch.cat([torch.arange(30).expand(2, 30), blocks.block_positions], 1)
    out = drafter(target(ids), target.embed_tokens(blocks.block_ids), position_ids, backend.attention,
                  backend.build_mask(anchors, keep, 30, bs))
    logp = F.log_softmax(out @ target.lm_head.weight.t(), -1).view(*blocks.labels.shape, -1)  # [B, N, bs, V]
    with torch.no_grad():
        target_logits = model(ids).logits  # [B, S, V]
    src = (blocks.block_positions - 1).clamp(min=0).view(*blocks.labels.shape)
    p_target = F.softmax(target_logits[torch.arange(2).view(-1, 1, 1), src] / o.distill_temperature, -1)
    q = (1 - o.distill_weight) * F.one_hot(blocks.labels, logp.shape[-1]).double() + o.distill_weight * p_target
    ce = -(q * logp).sum(-1)
    if o.slot_weighting == "gamma":
        w = blocks.weights.double()
    elif o.slot_weighting == "acceptance":
        w = _brute_force_acceptance(logp.detach(), blocks, o.acceptance_floor)
    else:
        label_logp = logp.detach().gather(-1, blocks.labels.unsqueeze(-1)).squeeze(-1)
        w = _brute_force_dpace(label_logp, blocks.counted, o.dpace_alpha)
    ref = (w * ce)[blocks.counted].sum() / w[blocks.counted].sum()
    ref_grads = torch.autograd.grad(ref, list(drafter.parameters()))
    torch.testing.assert_close(stats.loss, ref, rtol=1e-10, atol=1e-12)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-12)
    hits = (logp.argmax(-1) == blocks.labels) & blocks.counted
    assert torch.equal(stats.correct_per_slot, hits.sum((0, 1)))
    assert torch.equal(stats.counted_per_slot, blocks.counted.sum((0, 1)))


# ---------------------------------------------------------------------------- warmup-stable-decay


def test_wsd_schedule_values():
    total, warm, decay, floor = 100, 0.1, 0.2, 0.1
    f = [lr_factor(s, total, warm, floor, "wsd", decay) for s in range(total)]
    assert f[0] == pytest.approx(0.1) and f[9] == pytest.approx(1.0)  # warmup: 10 steps, ends at the peak
    assert all(x == 1.0 for x in f[10:81])  # stable: constant peak until the last 20 steps begin
    assert f[90] == pytest.approx(floor + (1 - floor) * 0.5)  # mid-decay
    assert f[99] == pytest.approx(floor + (1 - floor) / 20)  # last step: one decay step above the floor
    assert lr_factor(total, total, warm, floor, "wsd", decay) == pytest.approx(floor)
    assert all(a >= b for a, b in zip(f[9:], f[10:]))
    # no stable phase when warmup + decay fill the run
    g = [lr_factor(s, 10, 0.5, 0.0, "wsd", 0.5) for s in range(10)]
    assert g[4] == pytest.approx(1.0) and g[5] == pytest.approx(1.0) and g[9] == pytest.approx(0.2)
    # the config's default is wsd (it won at equal steps)
    assert config_from_dict({}).optim.schedule == "wsd"


# ---------------------------------------------------------------------------- short CPU runs with each option on


ACCEPTANCE = ("slots weighted by the drafter's probability of reaching them, floor 0.05 (objective.slot_weighting "
              "acceptance)")


@pytest.mark.parametrize("option, objective", [
    ({"objective": {"slot_weighting": "gamma"}}, "slots weighted exp(-k / 4) (objective.slot_weighting gamma)"),
    ({"objective": {"slot_weighting": "dpace", "dpace_alpha": 0.5}},
     "D-PACE slot weights, alpha 0.5 (objective.slot_weighting dpace)"),
    ({"optim": {"schedule": "cosine"}}, ACCEPTANCE),
    ({"objective": {"distill_weight": 0.5, "distill_temperature": 2.0}},
     f"{ACCEPTANCE}; + 0.5 x KL to the target (temperature 2)"),
    ({"optim": {"schedule": "wsd", "decay_ratio": 0.5, "min_lr_ratio": 0.1}}, ACCEPTANCE),
    ({"objective": {"max_anchors_per_batch": 8}}, ACCEPTANCE),
    ({"drafter": {"architecture": "dflash2"}},
     f"{ACCEPTANCE}; + 1 x the selector's cross-entropy over its top 32 candidates"),
])
def test_train_run_with_option_finishes_with_finite_loss(tmp_path, tiny_target_dir, counting_jsonl, option, objective,
                                                         caplog):
    """A short CPU run with the option on: finite losses, the option in the run's config.yaml, the schedule's lr,
    and train.log saying what the objective optimised."""
    from dflash_train.cli import main

    cfg = {
        "target": {"path": str(tiny_target_dir)},
        "drafter": {"num_draft_layers": 1, "block_size": 4, "attention_backend": "sdpa"},
        "data": {"train_files": [str(counting_jsonl)], "max_length": 256, "token_budget": 512, "max_batch_size": 2},
        "objective": {"max_anchors": 16, "gamma": 4.0},
        "optim": {"lr": 3e-3, "epochs": 10, "warmup_ratio": 0.2},
        "run": {"device": "cpu", "log_every": 1, "save_every": 100, "eval_every": 0, "progress_bar": False},
    }
    for section, keys in option.items():
        cfg[section].update(keys)
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    steps = 6
    with caplog.at_level(logging.INFO, logger="dflash_train"):
        assert main(["train", str(path), "--run-dir", str(tmp_path / "R"), "--max-steps", str(steps)]) == 0
    arch = cfg["drafter"].get("architecture", "dflash")
    assert f"objective ({arch}): cross-entropy on the data's next tokens; {objective}\n" in (
        tmp_path / "R" / "train.log").read_text()
    records = [json.loads(line) for line in (tmp_path / "R" / "metrics.jsonl").read_text().splitlines()]
    records = [r for r in records if "loss" in r]
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    assert all(math.isfinite(r["loss"]) and r["loss"] > 0 for r in records)
    resolved = yaml.safe_load((tmp_path / "R" / "config.yaml").read_text())
    for section, keys in option.items():
        assert {k: resolved[section][k] for k in keys} == keys
    o = cfg["optim"]
    for r in records:  # the logged lr is the schedule's value after that many optimizer steps
        expect = o["lr"] * lr_factor(r["step"], steps, o["warmup_ratio"], o.get("min_lr_ratio", 0.0),
                                     o.get("schedule", "wsd"), o.get("decay_ratio", 0.2))
        assert r["lr"] == pytest.approx(expect, rel=1e-9)


# ---------------------------------------------------------------------------- the compiled CUDA path (-m gpu)

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("alpha", [0.0, 0.4])
def test_compiled_cuda_loss_matches_the_dense_reference_in_bf16(alpha):
    """The compiled chunk math (bf16 logits, dynamic chunk rows) against float64 from the same bf16 inputs."""
    torch.backends.cuda.matmul.allow_tf32 = False
    g = torch.Generator().manual_seed(0)
    m, h, v = 2500, 128, 3000
    hidden = torch.randn(m, h, generator=g).bfloat16()
    weight = (torch.randn(v, h, generator=g) * 0.3).bfloat16()
    target_hidden = torch.randn(m, h, generator=g).bfloat16()
    labels = torch.randint(0, v, (m,), generator=g)

    def by_prob(label_logp):  # a weight that depends on the forward, like slot_weighting=acceptance
        return label_logp.exp().clamp_min(0.05)

    hid = hidden.cuda().requires_grad_(True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = chunked_weighted_ce(hid, weight.cuda(), labels.cuda(), by_prob,
                                  CEOptions(1024, distill_weight=alpha, temperature=1.5), target_hidden.cuda())
    (grad,) = torch.autograd.grad(out.loss, hid)
    ref_hidden = hidden.double().requires_grad_(True)
    logp = F.log_softmax(ref_hidden @ weight.double().t(), -1)
    ref_w = by_prob(logp.detach().gather(1, labels.unsqueeze(1)).squeeze(1))
    ref = _soft_ce_reference(ref_hidden, weight.double(), labels, ref_w, target_hidden.double(), alpha, 1.5)
    (ref_grad,) = torch.autograd.grad(ref, ref_hidden)
    assert abs(float(out.loss.detach()) - float(ref.detach())) < 1e-2 * float(ref.detach())
    assert float((out.weights.cpu().double() - ref_w).norm() / ref_w.norm()) < 2e-2
    assert float((grad.cpu().double() - ref_grad).norm() / ref_grad.norm()) < 3e-2
    assert torch.isfinite(grad).all()


@pytest.mark.gpu
@needs_cuda
def test_cuda_train_steps_with_every_option_on():
    """flex + bf16 + compiled chunks: acceptance weights, distillation (full target forward) and wsd."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from dflash_train.architectures.family.backend import resolve_backend
    from dflash_train.architectures.dflash.model import DFlashDrafter
    from dflash_train.architectures.family.config import make_drafter_config
    from dflash_train.target.capture import TargetCapture
    from dflash_train.data.batch import Batch
    from dflash_train.train.loop.step import TrainStep

    torch.manual_seed(0)
    tcfg = LlamaConfig(vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=32, initializer_range=0.5)
    model = LlamaForCausalLM(tcfg).cuda().to(torch.bfloat16).eval().requires_grad_(False)
    target = TargetCapture.from_model(model, [1, 2])
    bs = 16
    drafter = DFlashDrafter(make_drafter_config(tcfg, num_draft_layers=1, block_size=bs, target_layer_ids=[1, 2],
                                                mask_token_id=5)).cuda()
    cfg = config_from_dict({"drafter": {"block_size": bs, "num_draft_layers": 1},
                            "objective": {"max_anchors": 32, "slot_weighting": "acceptance", "distill_weight": 0.5},
                            "optim": {"schedule": "wsd", "warmup_ratio": 0.25, "decay_ratio": 0.5},
                            "data": {"max_length": 256, "token_budget": 1024}})
    step = TrainStep(drafter, target, resolve_backend("flex", torch.device("cuda"), bs), cfg, 4, torch.bfloat16,
                     torch.device("cuda"))
    g = torch.Generator().manual_seed(0)
    for i, s in enumerate((200, 150, 230, 180)):  # varying shapes: the dynamic compile path
        ids = torch.randint(10, 1000, (2, s), generator=g)
        stats = step(Batch(ids, torch.ones_like(ids), torch.tensor([s, s - 17])).to(torch.device("cuda")), i)
        assert torch.isfinite(stats.loss) and torch.isfinite(stats.grad_norm) and stats.counted_per_slot.sum() > 0
    assert step.skipped_steps == 0


@pytest.mark.gpu
@needs_cuda
def test_cuda_run_with_every_option_on_through_warmup_and_seal(tmp_path, tiny_target_dir, counting_jsonl):
    from dflash_train.cli import main

    cfg = {
        "target": {"path": str(tiny_target_dir)},
        "drafter": {"num_draft_layers": 1, "block_size": 16, "attention_backend": "flex"},
        "data": {"train_files": [str(counting_jsonl)], "max_length": 256, "token_budget": 2048, "max_batch_size": 8},
        "objective": {"max_anchors": 32, "slot_weighting": "acceptance", "distill_weight": 0.5},
        "optim": {"lr": 5e-3, "epochs": 20, "warmup_ratio": 0.1, "schedule": "wsd"},
        "run": {"device": "cuda", "log_every": 1, "save_every": 100, "progress_bar": False, "eval_every": 0},
    }
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert main(["train", str(path), "--run-dir", str(tmp_path / "R"), "--max-steps", "20"]) == 0
    records = [json.loads(line) for line in (tmp_path / "R" / "metrics.jsonl").read_text().splitlines()]
    assert all(math.isfinite(r["loss"]) for r in records) and records[-1]["loss"] < records[0]["loss"]
    # after warm-up nothing recompiles (the counter is per process: earlier tests may have added to it)
    assert records[-1]["recompiles"] == records[0]["recompiles"] and records[-1]["skipped_steps"] == 0
