"""Domino: the GRU and its one-step decoding form, the shifted labels, the objective (final and base CE with the
decaying base weight) against a dense float64 reference with gradients, the base weight's schedule, lossless
greedy decoding through the sequential correction, its config section, and a real training run with its resume."""

from __future__ import annotations

import json

import pytest
import torch

from dflash_train.algorithms.base import sdpa_attention
from dflash_train.algorithms.dflash.attention import resolve_backend
from dflash_train.algorithms.dflash.blocks import sample_anchors
from dflash_train.algorithms.dflash.mask import dense_mask
from dflash_train.algorithms.domino.config import make_domino_config
from dflash_train.algorithms.domino.model import DominoDrafter
from dflash_train.algorithms.domino.objective import DominoObjective, lambda_base, shifted_blocks
from dflash_train.config.load import config_from_dict
from dflash_train.data.batch import Batch
from dflash_train.errors import ConfigError
from dflash_train.infer.spec_decode import SpeculativeDecoder
from dflash_train.target.capture import TargetCapture, load_target_model


@pytest.fixture(scope="module")
def target(tiny_target_dir):
    return load_target_model(tiny_target_dir, torch.float32, torch.device("cpu"))


def domino(target, block_size=4, seed=0, prefix=1, perturb=0.0) -> DominoDrafter:
    torch.manual_seed(seed)
    cfg = make_domino_config(target.config, gru_hidden_dim=12, emb_dim=6, pure_draft_prefix_len=prefix,
                             num_draft_layers=2, block_size=block_size, target_layer_ids=[1, 4], mask_token_id=16)
    d = DominoDrafter(cfg)
    if perturb:  # a correction large enough to change the argmax of some slots
        with torch.no_grad():
            for p in d.embed_proj.parameters():
                p.normal_(0, perturb)
    return d.eval()


def domino_cfg(**objective):
    return config_from_dict({"drafter": {"architecture": "domino", "block_size": 4, "num_draft_layers": 2},
                             "objective": {"max_anchors": 6, "gamma": 3.0, "slot_weighting": "gamma", **objective},
                             "data": {"max_length": 64, "token_budget": 256}})


def test_one_gru_step_is_the_gru_over_the_sequence(target):
    d = domino(target)
    x = torch.randn(3, 5, d.config.hidden_size)
    seq = d.prefix_states(x)
    state = None
    for t in range(5):
        state = d.step_state(x[:, t], state)
        torch.testing.assert_close(state, seq[:, t], rtol=1e-5, atol=1e-6)
    assert d.prefix_gru.bias is False and "prefix_gru.bias_ih_l0" not in d.state_dict()


def test_shifted_labels_predict_the_next_token_from_every_slot():
    ids = torch.arange(100, 120).view(1, 20)
    loss_mask = torch.ones(1, 20, dtype=torch.long)
    loss_mask[0, 9] = 0
    anchors, keep = torch.tensor([[3, 6, 16]]), torch.tensor([[True, True, True]])
    b = shifted_blocks(ids, loss_mask, torch.tensor([19]), anchors, keep, 4, 7, 2.0)
    for n, a in enumerate([3, 6, 16]):
        assert b.labels[0, n].tolist() == [100 + min(a + k + 1, 19) for k in range(4)]
        assert b.tokens[0, n].tolist() == [100 + a + k for k in range(4)]
        for k in range(4):
            want = a + k + 1 < 19 and a + k + 1 != 9
            assert bool(b.counted[0, n, k]) == want
            assert float(b.weights[0, n, k]) == pytest.approx(torch.exp(torch.tensor(-k / 2.0)).item() * want)
    assert b.block_ids[0, :4].tolist() == [103, 7, 7, 7] and b.block_positions[0, :4].tolist() == [3, 4, 5, 6]


def test_the_base_weight_falls_linearly_over_its_horizon():
    assert lambda_base(0, 100, 1.0, 0.5) == 1.0
    assert lambda_base(25, 100, 1.0, 0.5) == pytest.approx(0.5)
    assert lambda_base(50, 100, 1.0, 0.5) == 0.0 and lambda_base(90, 100, 1.0, 0.5) == 0.0
    assert lambda_base(10, 100, 0.6, 1.0) == pytest.approx(0.54)
    assert lambda_base(0, 100, 1.0, 0.0) == 0.0 and lambda_base(0, 0, 1.0, 1.0) == 0.0


def dense_reference(d, capture, ids, loss_mask, lengths, prefix, lam):
    """The loss written out: every block's full float64 logits, the GRU unrolled step by step by hand."""
    anchors, keep = sample_anchors(loss_mask, lengths, 4, 6, torch.Generator().manual_seed(7), 1)
    hidden = capture(ids)
    loss_f = loss_b = wsum = 0.0
    head = capture.lm_head.weight
    w_ih, w_hh = d.prefix_gru.weight_ih_l0, d.prefix_gru.weight_hh_l0
    g = d.gru_hidden_dim
    # the backbone in DFlash's packed layout (tested against its own references elsewhere)
    block_ids = torch.full((ids.shape[0], anchors.shape[1], 4), 16)
    block_ids[..., 0] = ids.gather(1, anchors)
    positions = (anchors.unsqueeze(-1) + torch.arange(4)).view(ids.shape[0], -1)
    pos = torch.cat([torch.arange(30).expand(ids.shape[0], 30), positions], 1)
    packed = d(hidden, capture.embed_tokens(block_ids.view(ids.shape[0], -1)), pos, sdpa_attention,
               dense_mask(anchors, keep, 30, 4)).view(ids.shape[0], anchors.shape[1], 4, -1)
    for row in range(ids.shape[0]):
        for n in range(anchors.shape[1]):
            if not keep[row, n]:
                continue
            a = int(anchors[row, n])
            out = packed[row, n]
            h = torch.zeros(g, dtype=torch.float64)
            for k in range(4):
                x = capture.embed_tokens(ids[row, a + k].view(1))[0]
                gi, gh = w_ih @ x, w_hh @ h
                r = torch.sigmoid(gi[:g] + gh[:g])
                u = torch.sigmoid(gi[g:2 * g] + gh[g:2 * g])
                c = torch.tanh(gi[2 * g:] + r * gh[2 * g:])
                h = (1 - u) * c + u * h  # the state after tokens a .. a + k
                p = a + k + 1
                if p >= int(lengths[row]) or not loss_mask[row, p]:
                    continue
                base = head @ out[k]
                final = base
                if k >= prefix:
                    bottleneck = torch.nn.functional.silu(d.embed_proj[0].weight @ torch.cat([out[k], h]))
                    final = base + d.embed_proj[2].weight @ bottleneck
                w = torch.exp(torch.tensor(-k / 3.0)).double()  # the blocks' weights are float32, as DFlash's
                y = int(ids[row, p])
                loss_f = loss_f - w * torch.log_softmax(final, -1)[y]
                loss_b = loss_b - w * torch.log_softmax(base, -1)[y]
                wsum = wsum + w
    return (1 - lam) * loss_f / wsum + lam * loss_b / wsum


@pytest.mark.parametrize("prefix,lam", [(1, 0.0), (1, 0.3), (2, 1.0), (2, 0.7)])
def test_the_objective_equals_a_dense_float64_reference(target, prefix, lam):
    d = domino(target, prefix=prefix, perturb=0.05).double().train()
    capture = TargetCapture.from_model(target.double(), [1, 4])
    try:
        backend = resolve_backend("sdpa", torch.device("cpu"), 4)
        g = torch.Generator().manual_seed(5)
        ids = torch.randint(3, 400, (2, 30), generator=g)
        loss_mask = (torch.rand(2, 30, generator=g) < 0.8).long()
        lengths = torch.tensor([30, 22])
        objective = DominoObjective(d, capture, backend, domino_cfg(), torch.float64)
        objective.lambda_base = lam
        stats = objective(Batch(ids, loss_mask, lengths), torch.Generator().manual_seed(7))
        params = [p for p in d.parameters() if p.requires_grad]
        grads = torch.autograd.grad(stats.loss, params, allow_unused=True)
        ref = dense_reference(d, capture, ids, loss_mask, lengths, prefix, lam)
        ref_grads = torch.autograd.grad(ref, params, allow_unused=True)
        torch.testing.assert_close(stats.loss, ref, rtol=1e-10, atol=1e-12)
        names = [n for n, _ in d.named_parameters() if _.requires_grad]
        for name, a, b in zip(names, grads, ref_grads):
            assert (a is None) == (b is None), name
            if a is not None:
                torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-10, msg=lambda m: f"{name}: {m}")
        gru = grads[names.index("prefix_gru.weight_hh_l0")]
        assert (gru.abs().sum() > 0) == (lam < 1)  # the correction trains only with weight on the final loss
    finally:
        target.float()


def test_greedy_decoding_through_the_correction_is_lossless_and_the_tree_is_refused(target):
    """A drafter whose correction changes its drafts: block decoding gives the target's own greedy tokens."""
    d = domino(target, perturb=0.5)
    dec = SpeculativeDecoder(target, d, stop_token_ids=[2])
    prompt = torch.randint(3, 49152, (9,), generator=torch.Generator().manual_seed(0)).tolist()
    assert dec.generate_block(prompt, 24).tokens == dec.generate_target_only(prompt, 24).tokens
    with pytest.raises(ValueError, match="without --tree-budget"):
        dec.generate_tree(prompt, 8, 6)
