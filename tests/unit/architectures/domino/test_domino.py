"""Domino: the GRU and its one-step decoding form, the shifted labels, the objective (final and base CE with the
decaying base weight; gamma, acceptance and dpace slot weights) against a dense float64 reference with gradients,
the base weight's schedule, lossless greedy decoding through the sequential correction, exact sampling through it,
the SGLang export layout read back by us and by an independent reader, its config section, and real training runs
(exported and evaluated; one with acceptance weights; one killed and resumed: long)."""

from __future__ import annotations

import json
import logging
import math
import signal

import pytest
import torch
import yaml
from safetensors import safe_open

from _reader_math import ReaderMath

from dflash_train.architectures import registry
from dflash_train.architectures import architecture_of_export
from dflash_train.architectures.attention import sdpa_attention
from dflash_train.architectures.family.backend import resolve_backend
from dflash_train.architectures.family.blocks import sample_anchors
from dflash_train.architectures.family.mask import dense_mask
from dflash_train.architectures.domino.config import make_domino_config
from dflash_train.architectures.domino.loss import chunked_domino_rows, final_label_logp
from dflash_train.architectures.domino.model import DominoDrafter
from dflash_train.architectures.domino.objective import DominoObjective, lambda_base, shifted_blocks
from dflash_train.architectures.io import load_drafter, save_drafter
from dflash_train.commands.export import parity_check
from dflash_train.config.load import config_from_dict
from dflash_train.data.batch import Batch
from dflash_train.errors import ConfigError
from dflash_train.infer.spec_decode import SpeculativeDecoder, speculative_accept
from dflash_train.target.capture import TargetCapture, load_target_model


@pytest.fixture(scope="module")
def target(tiny_target_dir):
    return load_target_model(tiny_target_dir, torch.float32, torch.device("cpu"))


def domino(target, block_size=4, seed=0, prefix=1, perturb=0.0, **transform) -> DominoDrafter:
    """`transform`: the score transform's `output_multiplier` and `final_logit_softcapping`."""
    torch.manual_seed(seed)
    cfg = make_domino_config(target.config, gru_hidden_dim=12, emb_dim=6, pure_draft_prefix_len=prefix,
                             num_draft_layers=2, block_size=block_size, target_layer_ids=[1, 4], mask_token_id=16,
                             **transform)
    d = DominoDrafter(cfg)
    if perturb:  # a correction large enough to change the argmax of some slots
        with torch.no_grad():
            d.embed_proj[0].weight.normal_(0, perturb)
            # the tiny target's tied head scores the mask token ~9 above the rest at an untrained drafter's slots
            d.embed_proj[2].weight.normal_(0, 8 * perturb)
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


def dense_slots(d, capture, ids, loss_mask, lengths, prefix, multiplier=1.0, softcap=None):
    """Every kept block's slots written out, `[(counted, final label log-prob, base label log-prob)]` a block (None
    where the slot does not count): every block's full float64 logits (the score transform on both), the GRU
    unrolled step by step by hand."""
    anchors, keep = sample_anchors(loss_mask, lengths, 4, 6, torch.Generator().manual_seed(7), 1)
    hidden = capture(ids)
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
    blocks = []
    for row in range(ids.shape[0]):
        for n in range(anchors.shape[1]):
            if not keep[row, n]:
                continue
            a = int(anchors[row, n])
            out = packed[row, n]
            h = torch.zeros(g, dtype=torch.float64)
            slots = []
            for k in range(4):
                x = capture.embed_tokens(ids[row, a + k].view(1))[0]
                gi, gh = w_ih @ x, w_hh @ h
                r = torch.sigmoid(gi[:g] + gh[:g])
                u = torch.sigmoid(gi[g:2 * g] + gh[g:2 * g])
                c = torch.tanh(gi[2 * g:] + r * gh[2 * g:])
                h = (1 - u) * c + u * h  # the state after tokens a .. a + k
                p = a + k + 1
                if p >= int(lengths[row]) or not loss_mask[row, p]:
                    slots.append((False, None, None))
                    continue
                base = head @ out[k]
                final = base
                if k >= prefix:
                    bottleneck = torch.nn.functional.silu(d.embed_proj[0].weight @ torch.cat([out[k], h]))
                    final = base + d.embed_proj[2].weight @ bottleneck
                y = int(ids[row, p])
                base, final = base * multiplier, final * multiplier
                if softcap:
                    base, final = softcap * torch.tanh(base / softcap), softcap * torch.tanh(final / softcap)
                slots.append((True, torch.log_softmax(final, -1)[y], torch.log_softmax(base, -1)[y]))
            blocks.append(slots)
    return blocks


def dense_reference(d, capture, ids, loss_mask, lengths, prefix, lam, multiplier=1.0, softcap=None):
    """The loss written out (`dense_slots`), slot k weighing exp(-k / gamma)."""
    loss_f = loss_b = wsum = 0.0
    for slots in dense_slots(d, capture, ids, loss_mask, lengths, prefix, multiplier, softcap):
        for k, (counted, final, base) in enumerate(slots):
            if counted:
                w = torch.exp(torch.tensor(-k / 3.0)).double()  # the blocks' weights are float32, as DFlash's
                loss_f, loss_b, wsum = loss_f - w * final, loss_b - w * base, wsum + w
    return (1 - lam) * loss_f / wsum + lam * loss_b / wsum


def reference_slot_weights(slots, weighting: str, floor: float, alpha: float) -> list[float]:
    """One block's slot weights by their definitions, slot by slot, from the final scores' label probabilities `q`
    (no gradient): acceptance, `max(prod q over the counted slots before, floor)`; dpace, `sum over counted m >= j
    of prod over counted i <= m of ((1 - alpha) q_i + alpha)`. An uncounted slot weighs 0 and is no factor."""
    q = [math.exp(float(final.detach())) if counted else None for counted, final, _ in slots]
    weights = [0.0] * len(slots)
    if weighting == "acceptance":
        reach = 1.0  # slot 0 is the first draft: always reached
        for k, p in enumerate(q):
            if p is not None:
                weights[k] = max(reach, floor)
                reach *= p
        return weights
    counted = [k for k, p in enumerate(q) if p is not None]
    for j in counted:
        for m in counted:
            if m >= j:
                weights[j] += math.prod((1 - alpha) * q[i] + alpha for i in counted if i <= m)
    return weights


def weighted_reference(d, capture, ids, loss_mask, lengths, prefix, lam, weighting, floor, alpha, multiplier=1.0,
                       softcap=None):
    """(the loss written out with acceptance or dpace weights, every counted slot's weight by block)."""
    loss_f = loss_b = wsum = 0.0
    all_weights = []
    for slots in dense_slots(d, capture, ids, loss_mask, lengths, prefix, multiplier, softcap):
        weights = reference_slot_weights(slots, weighting, floor, alpha)
        all_weights.append(weights)
        for w, (counted, final, base) in zip(weights, slots):
            if counted:
                loss_f, loss_b, wsum = loss_f - w * final, loss_b - w * base, wsum + w
    return (1 - lam) * loss_f / wsum + lam * loss_b / wsum, all_weights


def assert_equal_loss_and_gradients(d, loss: torch.Tensor, ref: torch.Tensor) -> dict:
    """The objective's loss and the gradient of every trained parameter of `d` equal the float64 reference's;
    returns the gradients by parameter name."""
    names, params = zip(*[(n, p) for n, p in d.named_parameters() if p.requires_grad])
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    ref_grads = torch.autograd.grad(ref, params, allow_unused=True)
    torch.testing.assert_close(loss, ref, rtol=1e-10, atol=1e-12)
    for name, a, b in zip(names, grads, ref_grads):
        assert (a is None) == (b is None), name
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-10, msg=lambda m: f"{name}: {m}")
    return dict(zip(names, grads))


def objective_stats(d, capture, cfg, lam: float, ids, loss_mask, lengths):
    """Domino's objective in float64 on one batch, the base loss weighing `lam`, the anchors of seed 7."""
    objective = DominoObjective(d, capture, resolve_backend("sdpa", torch.device("cpu"), 4), cfg, torch.float64)
    objective.lambda_base = lam
    return objective(Batch(ids, loss_mask, lengths), torch.Generator().manual_seed(7))


@pytest.mark.parametrize("prefix,lam,chunk,transform", [
    (1, 0.0, 2048, {}), (1, 0.3, 5, {}), (2, 1.0, 5, {}), (2, 0.7, 2048, {}),
    (1, 0.4, 7, {"output_multiplier": 1.7, "final_logit_softcapping": 6.0})])
def test_the_objective_equals_a_dense_float64_reference(target, prefix, lam, chunk, transform):
    """One lm_head pass for both terms, in chunks of `chunk` rows, with or without the score transform."""
    d = domino(target, prefix=prefix, perturb=0.05, **transform).double().train()
    capture = TargetCapture.from_model(target.double(), [1, 4])
    try:
        g = torch.Generator().manual_seed(5)
        ids = torch.randint(3, 400, (2, 30), generator=g)
        loss_mask = (torch.rand(2, 30, generator=g) < 0.8).long()
        lengths = torch.tensor([30, 22])
        stats = objective_stats(d, capture, domino_cfg(loss_chunk_size=chunk), lam, ids, loss_mask, lengths)
        ref = dense_reference(d, capture, ids, loss_mask, lengths, prefix, lam,
                              transform.get("output_multiplier", 1.0), transform.get("final_logit_softcapping"))
        grads = assert_equal_loss_and_gradients(d, stats.loss, ref)
        gru = grads["prefix_gru.weight_hh_l0"]
        assert (gru.abs().sum() > 0) == (lam < 1)  # the correction trains only with weight on the final loss
    finally:
        target.float()


@pytest.mark.parametrize("weighting,prefix,lam,chunk,transform", [
    ("acceptance", 1, 0.3, 5, {}), ("dpace", 2, 0.6, 7, {}),
    ("acceptance", 1, 0.4, 7, {"output_multiplier": 0.8, "final_logit_softcapping": 30.0}),
    ("dpace", 1, 0.0, 2048, {"output_multiplier": 0.8})])
def test_acceptance_and_dpace_weights_of_the_final_scores_equal_a_dense_float64_reference(target, weighting, prefix,
                                                                                           lam, chunk, transform):
    """Slot weights made of the corrected scores' label probabilities (a gradient-free chunked pass before the loss)
    against a reference with full float64 logits and the weights by their definitions, slot by slot; both terms
    take the weights, slot 0 is reached always, an uncounted slot (sequence end, loss mask) is no factor."""
    floor, alpha = 0.01, 0.3
    d = domino(target, prefix=prefix, perturb=0.3, **transform).double().train()
    capture = TargetCapture.from_model(target.double(), [1, 4])
    try:
        g = torch.Generator().manual_seed(5)
        ids = torch.randint(3, 400, (2, 30), generator=g)
        # half the tokens the mask token, which the tiny target's tied head scores high at the drafter's slots:
        # labels of every probability, from near 1 to near 0
        ids = torch.where(torch.rand(2, 30, generator=g) < 0.5, torch.full_like(ids, 16), ids)
        loss_mask = (torch.rand(2, 30, generator=g) < 0.8).long()
        lengths = torch.tensor([30, 10])  # the second row: every anchor it has, the last one cut by its end
        cfg = domino_cfg(loss_chunk_size=chunk, slot_weighting=weighting, acceptance_floor=floor, dpace_alpha=alpha)
        stats = objective_stats(d, capture, cfg, lam, ids, loss_mask, lengths)
        multiplier, softcap = transform.get("output_multiplier", 1.0), transform.get("final_logit_softcapping")
        ref, weights = weighted_reference(d, capture, ids, loss_mask, lengths, prefix, lam, weighting, floor, alpha,
                                          multiplier, softcap)
        grads = assert_equal_loss_and_gradients(d, stats.loss, ref)
        assert {"embed_proj.2.weight", "embed_proj.0.weight", "layers.0.mlp.up_proj.weight"} <= set(grads)
        # the case is one that tells: several chunks, blocks cut by the sequence end and by the loss mask, and
        # weights that follow the drafter's probabilities (neither one value a slot nor the floor throughout)
        rows = int(stats.counted_per_slot.sum())
        assert chunk == 2048 or rows > 2 * chunk
        counted = [[c for c, _, _ in slots] for slots in dense_slots(d, capture, ids, loss_mask, lengths, prefix)]
        assert any(not c[j] and c[j + 1] for c in counted for j in range(3))  # a hole, then a counted slot
        anchors, keep = sample_anchors(loss_mask, lengths, 4, 6, torch.Generator().manual_seed(7), 1)
        assert bool((keep & (anchors + 4 == lengths.view(-1, 1))).any())  # a block cut by its sequence's end
        by_slot = [{round(w[k], 9) for w in weights if w[k]} for k in range(1, 4)]
        assert all(len(values) > 2 for values in by_slot), by_slot
    finally:
        target.float()


@pytest.mark.parametrize("transform", [{}, {"output_multiplier": 0.5, "softcap": 4.0}])
def test_the_chunk_math_compiles_one_graph_that_no_batch_recompiles(monkeypatch, transform):
    """On CUDA the chunk's elementwise math (both terms, both gradients; and the weights pass's label
    log-probabilities) compiles with dynamic rows (Dynamo's eager backend on the CPU: the same tracing, one graph
    with fullgraph, and the same guards): one graph each, none more for other row counts, chunk splits or base
    weights (the weights are tensors, never Python floats). The weights pass's values are minus the final CE."""
    from dflash_train.accel import compile as compile_layer
    from dflash_train.architectures.domino import loss as loss_mod

    monkeypatch.setattr(compile_layer, "_compiled", {})
    monkeypatch.setattr(loss_mod, "chunk_function", lambda name, fn, device, eager=None: compile_layer.compiled(
        f"test_{name}", fn, dynamic=True, backend="eager"))
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(0)
    head, correction = torch.randn(40, 12, generator=g), torch.randn(40, 5, generator=g).requires_grad_()

    def run(m: int, chunk: int, lam: float) -> None:
        hidden = torch.randn(m, 12, generator=g).requires_grad_()
        features = torch.randn(m, 5, generator=g).requires_grad_()
        w = torch.rand(m, generator=g)
        labels = torch.randint(0, 40, (m,), generator=g)
        out = chunked_domino_rows(hidden, features, head, correction, labels, (1 - lam) * w, lam * w, chunk,
                                  **transform)
        out.loss.backward()
        logp = final_label_logp(hidden, features, head, correction, labels, chunk, **transform)
        assert not logp.requires_grad
        torch.testing.assert_close(logp, -out.final_ce, rtol=1e-6, atol=1e-6)

    try:
        run(12, 5, 0.5)
        before = compile_layer.graphs_compiled()
        for m, chunk, lam in ((9, 4, 0.0), (19, 4, 1.0), (30, 7, 0.25), (5, 2048, 0.9), (2, 3, 0.5)):
            run(m, chunk, lam)
        assert compile_layer.graphs_compiled() == before
    finally:
        torch._dynamo.reset()


def test_greedy_decoding_through_the_correction_is_lossless_and_the_tree_is_refused(target):
    """A drafter whose correction changes its drafts: block decoding gives the target's own greedy tokens."""
    d = domino(target, perturb=0.5)
    dec = SpeculativeDecoder(target, d, stop_token_ids=[2])
    prompt = torch.randint(3, 49152, (9,), generator=torch.Generator().manual_seed(0)).tolist()
    assert dec.generate_block(prompt, 24).tokens == dec.generate_target_only(prompt, 24).tokens
    with pytest.raises(ValueError, match="without --tree-budget"):
        dec.generate_tree(prompt, 8, 6)


@pytest.mark.parametrize("prefix,transform", [(0, {}), (1, {}), (3, {"output_multiplier": 1.7,
                                                                      "final_logit_softcapping": 30.0})])
def test_greedy_drafts_take_one_head_product_and_equal_the_slot_by_slot_formula(target, prefix, transform):
    """`draft` scores every slot with one product with the head, then corrects slot by slot: each slot's argmax
    equals the formula computed slot by slot in float64 (head, plus the bottleneck of [z ; GRU state] from
    `pure_draft_prefix_len` on, then the score transform), the GRU reading the drafts before it."""
    import copy

    from dflash_train.architectures.family.reference_fields import transform_logits

    d = domino(target, block_size=5, prefix=prefix, perturb=0.5, **transform).double()
    head = copy.deepcopy(target.lm_head).double()
    embed = copy.deepcopy(target.get_input_embeddings()).double()
    g = torch.Generator().manual_seed(5)
    n, h = 4, target.config.hidden_size
    hidden = torch.randn(n, 5, h, generator=g, dtype=torch.float64)
    anchors = torch.randint(3, 400, (n,), generator=g)
    d.embed_block(embed, torch.cat([anchors.view(-1, 1), torch.full((n, 4), 16)], 1))
    calls = []
    hook = head.register_forward_hook(lambda *_: calls.append(1))
    try:
        with torch.no_grad():
            drafts, q = d.draft(hidden, head, anchors)
    finally:
        hook.remove()
    assert len(calls) == 1 and q is None and drafts.shape == (n, 4)
    corrected_any = False
    with torch.no_grad():
        state = d.step_state(embed(anchors), None)
        for i in range(4):
            z = hidden[:, i]
            raw = head(z)
            if i >= prefix:
                corrected = raw + d.embed_proj(torch.cat([z, state], -1))
                corrected_any |= bool((corrected.argmax(-1) != raw.argmax(-1)).any())
                raw = corrected
            expected = transform_logits(raw, d.output_multiplier, d.final_logit_softcapping).argmax(-1)
            assert torch.equal(drafts[:, i], expected), i
            state = d.step_state(embed(expected), state)
    assert corrected_any or prefix >= 3


# ---------------------------------------------------------------------------------------------------- export

# The served layout's tensors (SGLang's DFLASH reader with projector_type domino): DFlash's, then the correction's.
BACKBONE = {"fc.weight", "hidden_norm.weight", "norm.weight"} | {
    f"layers.{i}.{k}" for i in range(2) for k in (
        "input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_proj.weight",
        "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight", "self_attn.q_norm.weight",
        "self_attn.k_norm.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")}
CORRECTION = {"prefix_gru.weight_ih_l0", "prefix_gru.weight_hh_l0", "embed_proj.0.weight", "embed_proj.2.weight"}


def test_the_export_is_sglangs_layout_holds_no_target_table_and_reloads(target, tmp_path):
    d = domino(target, perturb=0.2)
    d.embed_block(target.get_input_embeddings(), torch.tensor([[5, 16, 16, 16]]))  # as training and decoding do
    out = save_drafter(d, tmp_path / "E", dtype="float32")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["model_type"] == "qwen3" and "auto_map" not in cfg
    assert {k: cfg["dflash_config"][k] for k in ("projector_type", "shift_label", "pure_draft_prefix_len",
                                                  "gru_hidden_dim", "emb_dim", "mask_token_id", "target_layer_ids")} == {
        "projector_type": "domino", "shift_label": True, "pure_draft_prefix_len": 1, "gru_hidden_dim": 12,
        "emb_dim": 6, "mask_token_id": 16, "target_layer_ids": [1, 4]}
    assert cfg["emb_dim"] == 6 and cfg["block_size"] == 4 and cfg["num_target_layers"] == 6
    h, v = target.config.hidden_size, target.config.vocab_size
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert set(f.keys()) == BACKBONE | CORRECTION  # no embed_tokens, lm_head, GRU biases
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in CORRECTION}
    assert shapes == {"prefix_gru.weight_ih_l0": (36, h), "prefix_gru.weight_hh_l0": (36, 12),
                      "embed_proj.0.weight": (6, h + 12), "embed_proj.2.weight": (v, 6)}
    assert architecture_of_export(cfg).name == "domino"
    back = load_drafter(out)
    assert type(back) is DominoDrafter
    assert d.state_dict().keys() == back.state_dict().keys()
    for k, t in d.state_dict().items():
        assert torch.equal(back.state_dict()[k], t), k
    # the same file without the mark is a DFlash drafter's; with another projector it is refused, naming the key
    plain = {**cfg, "dflash_config": {k: x for k, x in cfg["dflash_config"].items() if k != "projector_type"}}
    assert architecture_of_export(plain).name == "dflash"
    with pytest.raises(registry.NotAnExport, match="dflash_config.projector_type 'dspark'"):
        architecture_of_export({**cfg, "dflash_config": {**cfg["dflash_config"], "projector_type": "dspark"}})


def test_the_export_parity_check_compares_the_correction_too(target, tmp_path):
    """The backbone's forward never runs the GRU or the projector: the parity check compares every tensor."""
    d = domino(target, perturb=0.2)
    back = load_drafter(save_drafter(d, tmp_path / "E", dtype="float32"))
    parity_check(d, back, torch.float32)
    with torch.no_grad():
        back.prefix_gru.weight_hh_l0[0, 0] += 1e-3
    with pytest.raises(RuntimeError, match="tensor prefix_gru.weight_hh_l0 differs"):
        parity_check(d, back, torch.float32)


class MinimalDomino(ReaderMath):
    """An independent reading of the served Domino layout (config.json and safetensors by name, plain tensor math):
    DFlash's backbone over one block per call, context recomputed from every captured feature (no cache), then
    SGLang's greedy rollout: draft 0 from the backbone's scores, each later one with the correction from a GRU
    primed on the anchor and the drafts before it."""

    def __init__(self, folder):
        self.cfg = json.loads((folder / "config.json").read_text())
        with safe_open(str(folder / "model.safetensors"), "pt") as f:
            self.w = {k: f.get_tensor(k).float() for k in f.keys()}
        dc = self.cfg["dflash_config"]
        assert dc["projector_type"] == "domino" and dc["shift_label"] is True and dc["pure_draft_prefix_len"] == 1
        self.bs, self.mask_id, self.layer_ids = self.cfg["block_size"], dc["mask_token_id"], dc["target_layer_ids"]
        self.g = dc["gru_hidden_dim"]
        self.eps = self.cfg["rms_norm_eps"]
        self.heads, self.kv, self.hd = self.cfg["num_attention_heads"], self.cfg["num_key_value_heads"], self.cfg["head_dim"]
        theta = self.cfg.get("rope_theta") or self.cfg["rope_parameters"]["rope_theta"]
        self.inv_freq = 1.0 / theta ** (torch.arange(0, self.hd, 2).float() / self.hd)
        self.proposed: list[tuple[list[int], list[int]]] = []  # (drafts, the backbone's own argmaxes) per block

    def gru(self, x, h):
        gi, gh = self.w["prefix_gru.weight_ih_l0"] @ x, self.w["prefix_gru.weight_hh_l0"] @ h
        g = self.g
        r, u = torch.sigmoid(gi[:g] + gh[:g]), torch.sigmoid(gi[g:2 * g] + gh[g:2 * g])
        n = torch.tanh(gi[2 * g:] + r * gh[2 * g:])
        return (1 - u) * n + u * h

    def backbone(self, features, anchor, start, embed):
        ctx = self.rms(features @ self.w["fc.weight"].T, self.w["hidden_norm.weight"])
        x = embed(torch.tensor([anchor] + [self.mask_id] * (self.bs - 1)))
        qpos, kpos = torch.arange(start, start + self.bs), torch.arange(start + self.bs)
        for i in range(self.cfg["num_hidden_layers"]):
            p = f"layers.{i}."
            u = self.rms(x, self.w[p + "input_layernorm.weight"])
            q = (u @ self.w[p + "self_attn.q_proj.weight"].T).view(self.bs, self.heads, self.hd)
            kv_in = torch.cat([ctx, u])
            k = (kv_in @ self.w[p + "self_attn.k_proj.weight"].T).view(-1, self.kv, self.hd)
            v = (kv_in @ self.w[p + "self_attn.v_proj.weight"].T).view(-1, self.kv, self.hd)
            q = self.rope(self.rms(q, self.w[p + "self_attn.q_norm.weight"]).transpose(0, 1), qpos)
            k = self.rope(self.rms(k, self.w[p + "self_attn.k_norm.weight"]).transpose(0, 1), kpos)
            rep = self.heads // self.kv
            att = torch.softmax(q @ k.repeat_interleave(rep, 0).transpose(1, 2) / self.hd ** 0.5, -1)
            o = (att @ v.transpose(0, 1).repeat_interleave(rep, 0)).transpose(0, 1).reshape(self.bs, -1)
            x = x + o @ self.w[p + "self_attn.o_proj.weight"].T
            u = self.rms(x, self.w[p + "post_attention_layernorm.weight"])
            m = torch.nn.functional.silu(u @ self.w[p + "mlp.gate_proj.weight"].T) * (u @ self.w[p + "mlp.up_proj.weight"].T)
            x = x + m @ self.w[p + "mlp.down_proj.weight"].T
        return self.rms(x, self.w["norm.weight"])

    def propose(self, features, anchor, start, embed, head):
        """features `[start, K*H]` of positions 0..start-1; the block anchored at position `start` -> B-1 drafts."""
        z = self.backbone(features, anchor, start, embed)[: self.bs - 1]
        base = head(z)
        drafts = [int(base[0].argmax())]
        h = self.gru(embed(torch.tensor(anchor)), torch.zeros(self.g))
        for i in range(1, self.bs - 1):
            h = self.gru(embed(torch.tensor(drafts[-1])), h)
            delta = self.w["embed_proj.2.weight"] @ torch.nn.functional.silu(
                self.w["embed_proj.0.weight"] @ torch.cat([z[i], h]))
            drafts.append(int((base[i] + delta).argmax()))
        self.proposed.append((drafts, base.argmax(-1).tolist()))
        return drafts

    def generate(self, target, prompt, max_new, stop):
        """Greedy block decoding with the target run over the whole text each step: (tokens, accept lengths)."""
        embed, head = target.get_input_embeddings(), target.get_output_embeddings()

        def run(ids):
            out = target(input_ids=torch.tensor([ids]), output_hidden_states=True)
            return torch.cat([out.hidden_states[i + 1][0] for i in self.layer_ids], -1), out.logits[0].argmax(-1)

        feats, nxt = run(prompt)
        tokens, new, accepts, start = [int(nxt[-1])], [int(nxt[-1])], [], len(prompt)
        while len(tokens) < max_new and stop not in new:
            anchor = tokens[-1]
            drafts = self.propose(feats[:start], anchor, start, embed, head)
            feats, posterior = run(prompt + tokens + drafts)
            post = posterior[start:].tolist()
            n = 0
            while n < len(drafts) and drafts[n] == post[n]:
                n += 1
            new = drafts[:n] + [post[n]]
            tokens += new
            accepts.append(n + 1)
            start += n + 1
        tokens = tokens[:max_new]
        return (tokens[: tokens.index(stop) + 1] if stop in tokens else tokens), accepts


def test_an_independent_reader_of_the_export_decodes_our_tokens_and_acceptance(target, tmp_path):
    d = domino(target, perturb=0.5)
    out = save_drafter(d, tmp_path / "E", dtype="float32")
    ref = MinimalDomino(out)
    dec = SpeculativeDecoder(target, load_drafter(out), stop_token_ids=[2])
    seen = []
    original = dec._draft

    def recorded(context, anchor, start, dcache):
        drafts, q = original(context, anchor, start, dcache)
        seen.append(drafts.tolist())
        return drafts, q

    dec._draft = recorded
    prompt = [5, 77, 901, 12, 4, 3000, 18]
    ours = dec.generate_block(prompt, 20)
    with torch.no_grad():
        theirs, accepts = ref.generate(target, prompt, 20, 2)
    assert [drafts for drafts, _ in ref.proposed] == seen
    assert theirs == ours.tokens and accepts == ours.accept_lengths
    assert any(drafts != base for drafts, base in ref.proposed)  # the correction decided some drafts


# ---------------------------------------------------------------------------------------------------- sampling


def test_sampled_block_decoding_through_the_correction_follows_the_target_distribution():
    """Exact speculative sampling over a Domino block: the first two tokens after the anchor follow the target's
    joint distribution (chi-square over every pair, fixed seed). An 8-token vocabulary; the second draft is sampled
    from the corrected scores given the first, and `draft` must return that conditional `q`."""
    from transformers import Qwen3Config

    v, bs, trials = 8, 3, 12000
    tcfg = Qwen3Config(vocab_size=v, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    torch.manual_seed(0)
    cfg = make_domino_config(tcfg, gru_hidden_dim=8, emb_dim=4, num_draft_layers=1, block_size=bs,
                             target_layer_ids=[1, 2], mask_token_id=v - 1)
    d = DominoDrafter(cfg).eval()
    embed, head = torch.nn.Embedding(v, 32), torch.nn.Linear(32, v, bias=False)
    with torch.no_grad():  # a correction that moves the second slot's distribution
        d.embed_proj[0].weight.normal_(0, 0.5)
        d.embed_proj[2].weight.normal_(0, 1.0)
        head.weight.normal_(0, 0.1)
    g = torch.Generator().manual_seed(0)
    p1 = torch.randn(v, generator=g)  # the target's logits for the first token after the anchor
    p2 = torch.randn(v, v, generator=g)  # ... for the second, given the first
    p3 = torch.randn(v, v, v, generator=g)  # ... for the bonus, given both
    anchor = 3
    hidden = torch.randn(1, bs, 32, generator=g)
    d.embed_block(embed, torch.tensor([[anchor] + [v - 1] * (bs - 1)]))
    with torch.no_grad():
        drafts, q = d.draft(hidden.expand(trials, -1, -1), head, torch.full((trials,), anchor), 1.0, g)
        base_q = torch.softmax(d.logits(hidden[:, 1], head), -1)[0]
    counts = torch.zeros(v, v)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # thousands of [3, 8] ops: a thread pool's wake-ups would cost more than the math
    try:
        for i in range(trials):
            a, b = drafts[i].tolist()
            logits = torch.stack([p1, p2[a], p3[a, b]])
            n_acc, bonus = speculative_accept(drafts[i], q[i], logits, 1.0, g)
            first = a if n_acc >= 1 else bonus
            # the second token: this block's when the first draft was accepted, else the next block's (any exact
            # method: drawn from the target here)
            if n_acc >= 1:
                second = b if n_acc == 2 else bonus
            else:
                second = int(torch.multinomial(p2[first].softmax(-1), 1, generator=g))
            counts[first, second] += 1
    finally:
        torch.set_num_threads(threads)
    expected = (p1.softmax(-1)[:, None] * p2.softmax(-1)) * trials
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 103.4, chi2  # chi-square, 63 degrees of freedom, p = 0.001
    # the second draft's distribution is the corrected one, far from the backbone's own
    assert float((q[:, 1] - base_q).abs().sum(-1).min()) > 0.2


# ---------------------------------------------------------------------------------------------------- a real run


def _run_config(tmp_path, tiny_target_dir, counting_jsonl):
    cfg = {
        "target": {"path": str(tiny_target_dir)},
        "drafter": {"architecture": "domino", "num_draft_layers": 1, "block_size": 4, "attention_backend": "sdpa"},
        "domino": {"gru_hidden_dim": 16, "emb_dim": 8, "lambda_base_decay_ratio": 1.0},
        "data": {"train_files": [str(counting_jsonl)], "max_length": 256, "token_budget": 512, "max_batch_size": 2},
        "objective": {"max_anchors": 16},
        "optim": {"lr": 3e-3, "epochs": 10, "warmup_ratio": 0.25, "max_steps": 6},
        "run": {"device": "cpu", "log_every": 1, "save_every": 2, "progress_bar": False, "eval_every": 0,
                "export_dtype": "float32"},
    }
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    return tmp_path / "c.yaml"


def test_a_domino_run_trains_exports_sglangs_layout_reloads_and_evaluates_losslessly(tiny_target_dir, counting_jsonl,
                                                                                     tmp_path):
    from dflash_train.cli import main

    whole = tmp_path / "whole"
    assert main(["train", str(_run_config(tmp_path, tiny_target_dir, counting_jsonl)), "--run-dir", str(whole)]) == 0
    records = [json.loads(x) for x in (whole / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3, 4, 5, 6]
    assert all("final_loss" in r and "base_loss" in r for r in records if "loss" in r)
    exported = json.loads((whole / "export" / "config.json").read_text())
    assert exported["architectures"] == ["DFlashDraftModel"] and exported["dflash_config"]["projector_type"] == "domino"
    assert exported["dflash_config"]["gru_hidden_dim"] == 16
    assert type(load_drafter(whole / "export")) is DominoDrafter
    out = tmp_path / "eval.json"
    assert main(["eval", "--target", str(tiny_target_dir), "--drafter", str(whole / "export"), "--data",
                 str(counting_jsonl), "--limit", "2", "--max-new-tokens", "8", "--out", str(out), "--no-progress",
                 "--device", "cpu"]) == 0
    body = json.loads(out.read_text())["datasets"][str(counting_jsonl)]
    assert body["modes"]["block"]["tau"] >= 1 and body["lossless_mismatches"] == []


def test_a_domino_run_with_acceptance_weights_trains_with_finite_losses(tiny_target_dir, counting_jsonl, tmp_path,
                                                                        caplog):
    from dflash_train.cli import main

    cfg = _run_config(tmp_path, tiny_target_dir, counting_jsonl)
    with caplog.at_level(logging.INFO, logger="dflash_train"):
        assert main(["train", str(cfg), "objective.slot_weighting=acceptance", "run.save_every=100", "--max-steps",
                     "3", "--run-dir", str(tmp_path / "R")]) == 0
    records = [json.loads(x) for x in (tmp_path / "R" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert all(math.isfinite(r[k]) for r in steps for k in ("loss", "final_loss", "base_loss"))
    assert yaml.safe_load((tmp_path / "R" / "config.yaml").read_text())["objective"]["slot_weighting"] == "acceptance"
    assert ("objective (domino): final (corrected) + base cross-entropy, the base's weight from 1 to 0 over 1 of the "
            "steps; slots weighted by the drafter's probability of reaching them, floor 0.05 (objective.slot_weighting "
            "acceptance)") in (tmp_path / "R" / "train.log").read_text()


@pytest.mark.long  # ~35 s: the run above again, and one in real processes killed and resumed
def test_a_domino_run_killed_and_resumed_reaches_the_uninterrupted_losses(tiny_target_dir, counting_jsonl, tmp_path):
    """Through the CLI in real processes: a run SIGKILLed after its step-2 checkpoint, resumed with --resume,
    logs the losses of the run that was never stopped (the base weight's schedule included)."""
    from _harness import assert_same_losses, launch, losses, run, wait_until

    from dflash_train.cli import main

    cfg = _run_config(tmp_path, tiny_target_dir, counting_jsonl)
    whole, part, log = tmp_path / "whole", tmp_path / "part", tmp_path / "run.log"
    assert main(["train", str(cfg), "--run-dir", str(whole)]) == 0
    proc = launch(["train", str(cfg), "--run-dir", str(part)], log)
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


def test_the_section_and_the_generic_keys_domino_does_not_support_are_checked_naming_them():
    base = {"drafter": {"architecture": "domino", "block_size": 4}}
    cfg = config_from_dict(base)
    assert cfg.objective.slot_weighting == "gamma" and cfg.objective.gamma == 7.0  # the reference recipes' weights
    assert (cfg.options.gru_hidden_dim, cfg.options.emb_dim, cfg.options.pure_draft_prefix_len) == (1024, 256, 1)
    refused = [
        ({"objective": {"slot_weighting": "greedy"}}, r"'objective.slot_weighting'.*got 'greedy'"),
        ({"objective": {"distill_weight": 0.5}}, r"'objective.distill_weight': Domino trains on the dataset's tokens"),
        ({"drafter": {"architecture": "domino", "block_size": 4, "draft_vocab_size": 100}},
         r"'drafter.draft_vocab_size'"),
        ({"domino": {"pure_draft_prefix_len": 4}}, r"'domino.pure_draft_prefix_len': must be below "
                                                   r"drafter.block_size=4"),
    ]
    for extra, message in refused:
        with pytest.raises(ConfigError, match=message):
            config_from_dict({**base, **extra})


@pytest.mark.parametrize("weighting", ["acceptance", "dpace"])
def test_slot_weights_of_the_corrected_scores_load_and_gamma_stays_the_default(weighting):
    cfg = config_from_dict({"drafter": {"architecture": "domino", "block_size": 4}},
                           [f"objective.slot_weighting={weighting}", "objective.acceptance_floor=0.1"])
    assert cfg.objective.slot_weighting == weighting and cfg.objective.acceptance_floor == 0.1
    assert config_from_dict({"drafter": {"architecture": "domino", "block_size": 4}}).objective.slot_weighting \
        == "gamma"
    assert config_from_dict({}).objective.slot_weighting == "acceptance"  # DFlash's default is its own
