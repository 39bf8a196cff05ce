"""Anchors, labels, weights and the chunked loss against independent references."""

import math

import pytest
import torch

from dflash_train.architectures.family.blocks import build_blocks, gamma_weights, sample_anchors
from dflash_train.architectures.family.loss import CEOptions, chunked_weighted_ce
from dflash_train.architectures.stats import acceptance_estimate
from dflash_train.train.loop.step import lr_factor


def test_anchors_are_valid_sorted_distinct_and_capped():
    g = torch.Generator().manual_seed(0)
    bs = 4
    loss_mask = (torch.rand(3, 40, generator=g) < 0.5).long()
    lengths = torch.tensor([40, 25, 9])
    anchors, keep = sample_anchors(loss_mask, lengths, bs, 6, g)
    for b in range(3):
        kept = anchors[b][keep[b]].tolist()
        valid = [p for p in range(40) if loss_mask[b, p] and p <= lengths[b] - bs]
        assert len(kept) == min(6, len(valid))
        assert kept == sorted(set(kept))
        assert set(kept) <= set(valid)


def test_anchors_resample_with_the_generator_and_repeat_with_the_seed():
    loss_mask = torch.ones(2, 200, dtype=torch.long)
    lengths = torch.tensor([200, 200])
    a1, _ = sample_anchors(loss_mask, lengths, 8, 10, torch.Generator().manual_seed(1))
    a2, _ = sample_anchors(loss_mask, lengths, 8, 10, torch.Generator().manual_seed(1))
    a3, _ = sample_anchors(loss_mask, lengths, 8, 10, torch.Generator().manual_seed(2))
    assert torch.equal(a1, a2) and not torch.equal(a1, a3)


@pytest.mark.parametrize("rows,cap,multiple", [(4, 64, 8), (4, 50, 8), (3, 7, 1), (16, 64, 8), (2, 0, 8)])
def test_a_batch_cap_bounds_the_blocks_computed(rows, cap, multiple):
    """rows x blocks <= the cap (or one tile per row when the cap is smaller); each row keeps
    min(valid, max_anchors, its share) anchors, all valid and distinct."""
    g = torch.Generator().manual_seed(rows + cap)
    seq, bs, max_anchors = 120, 4, 40
    loss_mask = (torch.rand(rows, seq, generator=g) < 0.7).long()
    lengths = torch.randint(2 * bs, seq + 1, (rows,), generator=g)
    anchors, keep = sample_anchors(loss_mask, lengths, bs, max_anchors, g, multiple, cap)
    share = max(cap // rows // multiple * multiple, multiple) if cap else max_anchors
    if cap:
        assert anchors.numel() <= max(cap, rows * multiple)
    assert anchors.shape[1] % multiple == 0
    for b in range(rows):
        valid = [p for p in range(seq) if loss_mask[b, p] and p <= lengths[b] - bs]
        kept = anchors[b][keep[b]].tolist()
        assert len(kept) == min(len(valid), max_anchors, share)
        assert kept == sorted(set(kept)) and set(kept) <= set(valid)


def test_anchor_count_rounds_up_with_unkept_blocks():
    loss_mask = torch.ones(1, 50, dtype=torch.long)
    anchors, keep = sample_anchors(loss_mask, torch.tensor([50]), 4, 5, torch.Generator().manual_seed(0), multiple_of=8)
    assert anchors.shape == (1, 8) and keep.sum() == 5 and not keep[0, 5:].any()


def test_labels_are_same_position_and_slot0_never_counts():
    g = torch.Generator().manual_seed(3)
    bs, gamma, mask_id = 5, 3.0, 999
    input_ids = torch.randint(0, 100, (2, 30), generator=g)
    loss_mask = (torch.rand(2, 30, generator=g) < 0.8).long()
    lengths = torch.tensor([30, 21])
    anchors, keep = sample_anchors(loss_mask, lengths, bs, 7, g)
    keep[1, 0] = False  # one more unkept block
    blk = build_blocks(input_ids, loss_mask, lengths, anchors, keep, bs, mask_id, gamma)
    w = gamma_weights(bs, gamma)
    for b in range(2):
        for n in range(anchors.shape[1]):
            a = int(anchors[b, n])
            ids = blk.block_ids.view(2, -1, bs)[b, n]
            assert ids[0] == input_ids[b, a] and (ids[1:] == mask_id).all()
            assert blk.block_positions.view(2, -1, bs)[b, n].tolist() == list(range(a, a + bs))
            for k in range(bs):
                counts = bool(keep[b, n]) and k >= 1 and a + k < lengths[b] and bool(loss_mask[b, a + k])
                expect = math.exp(-(k - 1) / gamma) if counts else 0.0
                assert blk.weights[b, n, k].item() == pytest.approx(expect, rel=1e-6)
                if counts:
                    assert blk.labels[b, n, k] == input_ids[b, a + k]
    assert w[0] == 0 and w[1] == 1.0


def _reference(hidden, weight, labels, weights):
    logits = hidden @ weight.t()
    ce = torch.nn.functional.cross_entropy(logits, labels, reduction="none")
    return (ce * weights).sum() / weights.sum(), logits.argmax(-1) == labels


@pytest.mark.parametrize("chunk", [1, 7, 64, 1000])
def test_chunked_loss_and_gradient_equal_unchunked_in_float64(chunk):
    g = torch.Generator().manual_seed(chunk)
    m, h, v = 37, 16, 50
    hidden = torch.randn(m, h, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(v, h, generator=g, dtype=torch.float64)
    labels = torch.randint(0, v, (m,), generator=g)
    weights = torch.rand(m, generator=g, dtype=torch.float64) + 0.1
    out = chunked_weighted_ce(hidden, weight, labels, weights, CEOptions(chunk))
    (grad,) = torch.autograd.grad(out.loss, hidden)
    ref_hidden = hidden.detach().clone().requires_grad_(True)
    ref, ref_correct = _reference(ref_hidden, weight, labels, weights)
    (ref_grad,) = torch.autograd.grad(ref, ref_hidden)
    torch.testing.assert_close(out.loss.double(), ref, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-6, atol=1e-10)
    assert torch.equal(out.correct, ref_correct)


@pytest.mark.parametrize("multiplier,cap,distill", [(0.2, None, 0.0), (1.0, 3.0, 0.0), (0.19611613513818404, 20.0, 0.0),
                                                     (2.5, 1.5, 0.0), (0.5, 2.0, 0.4)])
@pytest.mark.parametrize("chunk", [1, 7, 1000])
def test_chunked_loss_with_multiplier_and_softcap_equals_autograd_on_full_logits_in_float64(multiplier, cap, distill,
                                                                                            chunk):
    """The drafter's scores x = cap * tanh(m * z / cap) (x = m * z without a cap): loss, gradient (the chain rule
    through the transform), hits and the label log-probabilities acceptance weighting reads all equal autograd
    on the full transformed logits; the target's logits (distillation) stay untransformed."""
    from dflash_train.architectures.family.reference_fields import transform_logits
    from dflash_train.architectures.family.loss import chunked_ce_rows

    g = torch.Generator().manual_seed(chunk)
    m, h, v = 29, 16, 50
    hidden = torch.randn(m, h, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(v, h, generator=g, dtype=torch.float64) * 2  # logits of a few units: the cap bends them
    labels = torch.randint(0, v, (m,), generator=g)
    target_hidden = torch.randn(m, h, generator=g, dtype=torch.float64)
    weights = torch.rand(m, generator=g, dtype=torch.float64) + 0.1
    rows = chunked_ce_rows(hidden, weight, labels, CEOptions(chunk, distill, 1.0, multiplier, cap), target_hidden)
    (grad,) = torch.autograd.grad((rows.loss * weights).sum(), hidden)

    ref_hidden = hidden.detach().clone().requires_grad_(True)
    x = transform_logits(ref_hidden @ weight.t(), multiplier, cap)
    q = (1 - distill) * torch.nn.functional.one_hot(labels, v).double() + distill * torch.softmax(target_hidden @ weight.t(), -1)
    ref_rows = -(q * torch.log_softmax(x, -1)).sum(-1)
    (ref_grad,) = torch.autograd.grad((ref_rows * weights).sum(), ref_hidden)
    torch.testing.assert_close(rows.loss, ref_rows, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(rows.label_logp, torch.log_softmax(x, -1).gather(1, labels.view(-1, 1)).view(-1).detach())
    assert torch.equal(rows.correct, x.argmax(-1) == labels)
    plain = chunked_ce_rows(hidden, weight, labels, CEOptions(chunk, distill, 1.0), target_hidden)
    assert not torch.allclose(plain.loss, rows.loss, rtol=1e-3)  # the transform is not a no-op here


def test_the_eager_chunk_math_equals_the_compiled_one_in_float64():
    """CPU runs `_ce_chunk_eager` (in place, four passes); CUDA compiles `_ce_chunk`. Same outputs, ties in
    the argmax included (both take the first maximum)."""
    from dflash_train.architectures.family.loss import _ce_chunk, _ce_chunk_eager

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(23, 40, generator=g, dtype=torch.float64) * 4
    logits[3, 7] = logits[3, 11] = logits[3].max() + 1  # a tie for the top
    labels = torch.randint(0, 40, (23,), generator=g)
    labels[3] = 11
    for got, want in zip(_ce_chunk_eager(logits.clone(), labels), _ce_chunk(logits, labels)):
        if want.dtype == torch.bool:
            assert torch.equal(got, want)
        else:
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert not _ce_chunk_eager(logits, labels)[2][3]  # row 3's first maximum is 7, not its label 11


@pytest.mark.parametrize("chunk", [3, 4, 7, 2048])
def test_chunks_cover_the_rows_in_order_and_none_holds_one_row(chunk):
    from dflash_train.architectures.family.loss import chunk_bounds

    for m in range(1, 3 * chunk + 3):
        bounds = chunk_bounds(m, chunk)
        assert bounds[0][0] == 0 and bounds[-1][1] == m
        assert all(a < b and b == c for (a, b), (c, _) in zip(bounds, bounds[1:] + [(m, None)]))
        assert all(b - a <= chunk for a, b in bounds)
        assert m == 1 or all(b - a >= 2 for a, b in bounds), (m, bounds)


def test_no_micro_batch_size_gives_the_compiled_chunk_math_a_variant_of_its_own(monkeypatch):
    """The chunk math compiles with dynamic rows, but Dynamo specialises a chunk of one row: a micro-batch of
    k * chunk + 1 counted rows (seen on the GPU in a real-data warm-up) would compile a second variant, mid-run
    when the warm-up's batches had none. The chunks never hold one row, so one variant serves every count.
    (Dynamo's eager backend on the CPU: the same tracing and guards as the GPU's inductor.)"""
    from dflash_train.accel import compile as compile_layer
    from dflash_train.architectures.family import loss as loss_mod

    monkeypatch.setattr(compile_layer, "_compiled", {})
    monkeypatch.setattr(loss_mod, "chunk_function", lambda name, fn, device, eager=None: compile_layer.compiled(
        f"test_{name}", fn, dynamic=True, backend="eager"))
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(50, 8, generator=g)

    def run(m):
        h = torch.randn(m, 8, generator=g, requires_grad=True)
        out = chunked_weighted_ce(h, weight, torch.randint(0, 50, (m,), generator=g), torch.ones(m), CEOptions(4))
        out.loss.backward()

    run(10)  # chunks of 4, 4 and 2: the compile
    before = compile_layer.graphs_compiled()
    for m in (9, 13, 5, 2, 7, 17):  # 9, 13, 5, 17 would leave a last chunk of one row
        run(m)
    assert compile_layer.graphs_compiled() == before
    torch._dynamo.reset()


def test_chunked_loss_never_holds_full_logits():
    """Peak memory of the forward+backward stays near one chunk of logits, not M x V."""
    m, h, v, chunk = 4096, 32, 8192, 256
    hidden = torch.randn(m, h, requires_grad=True)
    weight = torch.randn(v, h)
    labels = torch.randint(0, v, (m,))
    weights = torch.ones(m)
    full_logits_bytes = m * v * 4
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = chunked_weighted_ce(hidden, weight, labels, weights, CEOptions(chunk))
        out.loss.backward()
    biggest = max((e.cpu_memory_usage for e in prof.events() if e.cpu_memory_usage > 0), default=0)
    assert 0 < biggest < full_logits_bytes / 8, (biggest, full_logits_bytes)


def test_acceptance_estimate_counts_the_leading_run_plus_bonus():
    correct = torch.tensor([[False, True, True, False, True], [True, False, True, True, True], [False] * 5])
    assert acceptance_estimate(correct).tolist() == [3, 1, 1]


def test_lr_schedule_warms_up_then_decays_by_cosine():
    total = 100
    f = [lr_factor(s, total, 0.04, 0.1, "cosine", 0.2) for s in range(total)]
    assert f[0] == pytest.approx(0.25) and f[3] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(f[3:], f[4:]))
    assert f[-1] == pytest.approx(0.1, abs=0.01)
    mid = 4 + (total - 4) // 2
    assert f[mid] == pytest.approx(0.1 + 0.9 * 0.5, abs=0.02)
