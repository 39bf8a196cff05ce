"""The six newer reference fields (`output_multiplier`, `final_logit_softcapping`, `input_embedding_scale`,
`layer_types`, `sliding_window`, `is_causal`): read from any drafter's config.json the reference way, honoured
by decoding (a KV cache), replay and training alike, exported explicitly, and lossless decoding unchanged."""

import json

import pytest
import torch

from dflash_train.architectures.attention import DrafterKVCache
from dflash_train.architectures.family.reference_fields import AttentionKind, layer_kinds, OutputFields, transform_logits
from dflash_train.architectures.family.backend import resolve_backend
from dflash_train.architectures.family.blocks import Blocks
from dflash_train.architectures.family.config import make_drafter_config
from dflash_train.architectures.attention import sdpa_attention
from dflash_train.architectures.dflash.model import DFlashDrafter
from dflash_train.architectures.dflash.objective import DFlashObjective
from dflash_train.config.load import config_from_dict
from dflash_train.data.batch import Batch
from dflash_train.infer.replay import proposals_from_context
from dflash_train.infer.spec_decode import SpeculativeDecoder
from dflash_train.architectures.io import load_drafter, save_drafter
from dflash_train.target.capture import TargetCapture, load_target_model
from test_mask import brute_force

LAYER_IDS = [1, 4]


def draft_logits(dec, context, anchor, start, cache):
    """Decoding's scores `[B-1, V]` of slots 1..B-1 for the block anchored at `start` (the drafter's transform)."""
    hidden, _ = dec._draft_hidden(context, anchor, start, cache)
    return dec.drafter.logits(hidden[0], dec.lm_head)[1:]


@pytest.fixture(scope="module")
def target(tiny_target_dir):
    return load_target_model(tiny_target_dir, torch.float32, torch.device("cpu"))


def make_drafter(target, block_size=4, layers=1, seed=0, **keys) -> DFlashDrafter:
    torch.manual_seed(seed)
    cfg = make_drafter_config(target.config, num_draft_layers=layers, block_size=block_size,
                              target_layer_ids=LAYER_IDS, mask_token_id=16, **keys)
    return DFlashDrafter(cfg).eval()


def reference_format(drafter, folder, top=None, dflash=None, drop=()) -> DFlashDrafter:
    """`drafter` saved, its config.json edited as a published drafter's would be written (top-level keys, then
    `dflash_config` keys; `drop`: top-level keys removed), and loaded back: same weights, new fields."""
    out = save_drafter(drafter, folder, dtype="float32")
    data = json.loads((out / "config.json").read_text())
    for key in drop:
        data.pop(key, None)
    data.update(top or {})
    data["dflash_config"].update(dflash or {})
    (out / "config.json").write_text(json.dumps(data))
    return load_drafter(out).eval()


def prompts():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 49152, (n,), generator=g).tolist() for n in (9, 21)]


def first_step(dec: SpeculativeDecoder, prompt):
    """(target features of the prompt, first anchor): what the first drafting step sees."""
    _, hidden, first, _ = dec._prefill(prompt)
    return hidden, first


# ---------------------------------------------------------------------------- reading the fields


def test_output_fields_are_read_from_dflash_config_first_then_the_top_level(target, tmp_path):
    d = make_drafter(target)
    both = reference_format(d, tmp_path / "a", top={"output_multiplier": 0.5, "input_embedding_scale": 3.0},
                            dflash={"output_multiplier": 0.25, "final_logit_softcapping": 20.0})
    assert both.output_fields == OutputFields(0.25, 20.0, 3.0)
    top = reference_format(d, tmp_path / "b", top={"final_logit_softcapping": 7.5})
    assert top.output_fields == OutputFields(1.0, 7.5, 1.0)
    off = reference_format(d, tmp_path / "c", top={"final_logit_softcapping": 30.0},
                           dflash={"final_logit_softcapping": 0, "output_multiplier": None})
    assert off.output_fields == OutputFields()  # dflash_config's 0 wins over the top level: off
    assert d.output_fields == OutputFields() and d.input_embedding_scale == 1.0


def test_layer_kinds_follow_the_reference_defaults(target, tmp_path):
    """`is_causal` absent: sliding layers causal, full ones not; set: that value for every layer. The window is
    the file's top-level `sliding_window`, also when `use_sliding_window` is missing (Qwen3Config would drop it)."""
    d = make_drafter(target, layers=2)
    types = {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 8}
    default = reference_format(d, tmp_path / "a", top=types, drop=("is_causal", "use_sliding_window"))
    assert default.layer_attention == [AttentionKind(8, True), AttentionKind(None, False)]
    off = reference_format(d, tmp_path / "b", top={**types, "is_causal": False})
    assert off.layer_attention == [AttentionKind(8, False), AttentionKind(None, False)]
    on = reference_format(d, tmp_path / "c", top={**types, "is_causal": True})
    assert on.layer_attention == [AttentionKind(8, True), AttentionKind(None, True)]
    old = reference_format(d, tmp_path / "d", drop=("layer_types", "is_causal", "sliding_window"))
    assert old.layer_attention == [AttentionKind(), AttentionKind()] and not old.needs_masks
    assert default.attention_kinds == [AttentionKind(8, True), AttentionKind(None, False)]


@pytest.mark.parametrize("top,dflash,key", [
    ({"layer_types": ["sliding_attention"], "sliding_window": None}, {}, "sliding_window"),
    ({"layer_types": ["sliding_attention"], "sliding_window": 0}, {}, "sliding_window"),
    ({"layer_types": ["local_attention"]}, {}, "layer_types"),
    ({"is_causal": "yes"}, {}, "is_causal"),
    ({}, {"output_multiplier": "big"}, "dflash_config.output_multiplier"),
    ({"input_embedding_scale": [2]}, {}, "input_embedding_scale"),
    ({}, {"final_logit_softcapping": -1.0}, "final_logit_softcapping"),
])
def test_unreadable_fields_are_refused_naming_the_key_and_the_file(target, tmp_path, top, dflash, key):
    with pytest.raises(ValueError, match=rf"config\.json.*{key}"):
        reference_format(make_drafter(target), tmp_path / "x", top=top, dflash=dflash)


# ---------------------------------------------------------------------------- decoding honours each field


def test_softcap_and_multiplier_transform_the_decoders_logits(target, tmp_path):
    """multiplier first, then cap * tanh(x / cap): against the same weights without the fields."""
    plain = make_drafter(target)
    capped = reference_format(plain, tmp_path / "a", dflash={"output_multiplier": 0.7, "final_logit_softcapping": 2.0})
    hidden, anchor = first_step(SpeculativeDecoder(target, plain), prompts()[1])
    start = len(prompts()[1])
    raw = draft_logits(SpeculativeDecoder(target, plain), hidden, anchor, start, DrafterKVCache(1))
    got = draft_logits(SpeculativeDecoder(target, capped), hidden, anchor, start, DrafterKVCache(1))
    torch.testing.assert_close(got, 2.0 * torch.tanh(raw * 0.7 / 2.0))
    assert (raw * 0.7).abs().max() > 4 and got.abs().max() <= 2.0  # the cap bends these logits
    only_cap = reference_format(plain, tmp_path / "b", top={"final_logit_softcapping": 2.0})
    torch.testing.assert_close(draft_logits(SpeculativeDecoder(target, only_cap), hidden, anchor, start,
                                                                                  DrafterKVCache(1)),
                               2.0 * torch.tanh(raw / 2.0))


def test_input_embedding_scale_multiplies_the_block_inputs_not_the_context(target, tmp_path):
    plain = make_drafter(target)
    scaled = reference_format(plain, tmp_path / "a", dflash={"input_embedding_scale": 3.0})
    prompt = prompts()[0]
    hidden, anchor = first_step(SpeculativeDecoder(target, plain), prompt)
    start = len(prompt)
    got = draft_logits(SpeculativeDecoder(target, scaled), hidden, anchor, start, DrafterKVCache(1))
    block = torch.tensor([[anchor] + [16] * 3])
    pos = torch.arange(start + 4).view(1, -1)
    with torch.no_grad():
        out = plain(hidden.unsqueeze(0), target.get_input_embeddings()(block) * 3.0, pos, sdpa_attention, None)
        expect = plain.logits(out[0], target.get_output_embeddings())[1:]
    torch.testing.assert_close(got, expect)
    raw = draft_logits(SpeculativeDecoder(target, plain), hidden, anchor, start, DrafterKVCache(1))
    assert not torch.allclose(got, raw, atol=1e-3)


@pytest.mark.parametrize("causal", [False, True])
def test_a_sliding_window_masks_exactly_the_context_keys_outside_it(target, tmp_path, causal):
    """One layer, window 6, block 4, decoding with a KV cache filled over two steps: slot i's logits change when
    context position k changes exactly for k >= start + i - W + 1 (q - k < W, absolute positions)."""
    window, bs = 6, 4
    plain = make_drafter(target, block_size=bs)
    d = reference_format(plain, tmp_path / "a", top={"layer_types": ["sliding_attention"], "sliding_window": window,
                                                     "use_sliding_window": True, "is_causal": causal})
    dec = SpeculativeDecoder(target, d)
    prompt = prompts()[1]
    hidden, anchor = first_step(dec, prompt)
    start = len(prompt)

    def logits(h):
        cache = DrafterKVCache(1)
        draft_logits(dec, h[: start - 3], 7, start - 3, cache)  # an earlier step puts positions < start - 3 in it
        return draft_logits(dec, h[start - 3:], anchor, start, cache)

    base = logits(hidden)
    g = torch.Generator().manual_seed(0)
    for k in range(start):
        moved = hidden.clone()
        moved[k] += torch.randn(moved.shape[1], generator=g) * 3
        out = logits(moved)
        for i in range(1, bs):  # row i - 1 is slot i
            sees = k >= start + i - window + 1
            if sees:
                assert not torch.allclose(out[i - 1], base[i - 1], atol=1e-4), (k, i)
            else:
                assert torch.equal(out[i - 1], base[i - 1]), (k, i)
    full = SpeculativeDecoder(target, plain)
    assert not torch.allclose(draft_logits(full, hidden, anchor, start, DrafterKVCache(1)), base, atol=1e-3)


def test_is_causal_makes_each_slot_blind_to_the_slots_after_it(target, tmp_path):
    """Causal: slots 1..2 of a block of 4 equal those of a block of 3 (nothing after them is seen), through two
    layers; bidirectional (the default), they differ."""
    plain = make_drafter(target, layers=2)
    causal = reference_format(plain, tmp_path / "a", top={"is_causal": True})
    assert causal.layer_attention == [AttentionKind(None, True)] * 2
    prompt = prompts()[0]
    hidden, anchor = first_step(SpeculativeDecoder(target, plain), prompt)
    start = len(prompt)

    def slots(drafter, bs):
        return draft_logits(SpeculativeDecoder(target, drafter, block_size=bs), hidden, anchor, start, DrafterKVCache(2))

    torch.testing.assert_close(slots(causal, 4)[:2], slots(causal, 3), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(slots(plain, 4)[:2], slots(plain, 3), atol=1e-3)


def test_mixed_layers_each_get_the_mask_of_their_kind(target, tmp_path):
    """A sliding layer and a full one: `dense_masks` builds one mask per kind, each layer's attention gets its
    kind's (seen by the attention function itself); one mask for all layers is refused."""
    d = reference_format(make_drafter(target, layers=3), tmp_path / "a",
                         top={"layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
                              "sliding_window": 5}, drop=("is_causal",))
    s, bs = 14, 4
    anchors, keep = torch.tensor([[3, 9]]), torch.tensor([[True, True]])
    masks = d.dense_masks(anchors, keep, s)
    assert list(masks) == [AttentionKind(5, True), AttentionKind(None, False)]
    assert torch.equal(masks[AttentionKind(5, True)], brute_force(anchors, keep, s, bs, window=5, causal=True))
    assert torch.equal(masks[AttentionKind(None, False)], brute_force(anchors, keep, s, bs))
    seen = []

    def attention(q, k, v, mask):
        seen.append(mask)
        return sdpa_attention(q, k, v, mask)

    hidden = torch.randn(1, s, 128)
    block = torch.randn(1, 8, 64)
    pos = torch.cat([torch.arange(s), (anchors.view(-1, 1) + torch.arange(bs)).view(-1)]).view(1, -1)
    with torch.no_grad():
        d(hidden, block, pos, attention, masks)
    assert [m is masks[k] for m, k in zip(seen, d.layer_attention)] == [True] * 3
    with pytest.raises(ValueError, match="layer 0 attends as .*sliding_window=5.*layer_masks"):
        d(hidden, block, pos, sdpa_attention, masks[AttentionKind(None, False)])
    with pytest.raises(ValueError, match="no mask for drafter layer 1"):
        d(hidden, block, pos, sdpa_attention, {AttentionKind(5, True): masks[AttentionKind(5, True)]})


# ---------------------------------------------------------------------------- lossless, replay, training

EDITS = {
    "softcap": ({}, {"final_logit_softcapping": 1.5}),
    "multiplier": ({}, {"output_multiplier": 0.2}),
    "input_scale": ({}, {"input_embedding_scale": 4.0}),
    "window": ({"layer_types": ["sliding_attention"] * 2, "sliding_window": 3, "is_causal": False}, {}),
    "causal": ({"is_causal": True}, {}),
    "all": ({"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 7},
            {"final_logit_softcapping": 3.0, "output_multiplier": 0.5, "input_embedding_scale": 2.0}),
}


@pytest.fixture(scope="module")
def references(target):
    dec = SpeculativeDecoder(target, make_drafter(target), stop_token_ids=[2])
    return [(p, dec.generate_target_only(p, 24).tokens) for p in prompts()]


@pytest.mark.parametrize("name", sorted(EDITS))
def test_decoding_a_reference_format_drafter_stays_lossless(target, references, tmp_path, name):
    top, dflash = EDITS[name]
    d = reference_format(make_drafter(target, layers=2), tmp_path / name, top=top, dflash=dflash, drop=("is_causal",))
    dec = SpeculativeDecoder(target, d, stop_token_ids=[2])
    for prompt, ref in references:
        assert dec.generate_block(prompt, 24).tokens == ref
        assert dec.generate_tree(prompt, 24, 6).tokens == ref


def test_replay_proposals_equal_the_decoders_for_every_field(target, tmp_path):
    """Replay (the training layout, one dense forward for all anchors) proposes what decoding with a KV cache
    proposes at each anchor: same top-k ids and log-probabilities, all six fields set."""
    top, dflash = EDITS["all"]
    d = reference_format(make_drafter(target, layers=2), tmp_path / "all", top={**top, "sliding_window": 5},
                         dflash=dflash, drop=("is_causal",))
    assert d.layer_attention == [AttentionKind(5, True), AttentionKind(None, False)]
    dec = SpeculativeDecoder(target, d)
    ids = prompts()[1] + prompts()[0]
    p = len(prompts()[1])
    with torch.no_grad():
        hs = target(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states
    context = torch.cat([hs[i + 1] for i in LAYER_IDS], -1)
    n = len(ids) - p - 1
    props = proposals_from_context(d, target.get_input_embeddings(), target.get_output_embeddings(), context, ids,
                                   p, n, top_k=5)
    for j in range(n):
        start = p + j
        lp = torch.log_softmax(draft_logits(dec, context[0, :start], ids[start], start, DrafterKVCache(2)), -1)
        top_lp, top_ids = lp.topk(5, dim=-1)
        assert torch.equal(props.top_ids[j], top_ids), j
        torch.testing.assert_close(props.top_lp[j], top_lp, rtol=1e-4, atol=1e-4)


def test_the_training_loss_uses_every_field(tiny_target_dir):
    """The objective's loss equals one computed by hand from the drafter's own forward with brute-force masks of
    each layer's kind, block inputs times the input scale, and the gamma-weighted CE of the transformed logits."""
    cfg = config_from_dict({"drafter": {"block_size": 4, "num_draft_layers": 2, "sliding_window": 6, "causal": True,
                                        "output_multiplier": 0.5, "final_logit_softcapping": 2.5},
                            "objective": {"max_anchors": 6, "slot_weighting": "gamma", "loss_chunk_size": 7},
                            "data": {"max_length": 64, "token_budget": 256}})
    model = load_target_model(tiny_target_dir, torch.float32, torch.device("cpu"))
    cap = TargetCapture.from_model(model, LAYER_IDS)
    d = make_drafter(model, layers=2, sliding_window=6, causal=True, output_multiplier=0.5,
                     final_logit_softcapping=2.5)
    d.config.dflash_config["input_embedding_scale"] = 1.5
    d.read_reference_fields(d.config)
    assert d.layer_attention == [AttentionKind(6, True)] * 2 and d.input_embedding_scale == 1.5
    objective = DFlashObjective(d, cap, resolve_backend("sdpa", torch.device("cpu"), 4), cfg, torch.float32)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 49152, (2, 40), generator=g)
    batch = Batch(ids, torch.ones_like(ids), torch.tensor([40, 33]))
    loss = objective(batch, torch.Generator().manual_seed(3)).loss

    blocks: Blocks = objective.plan_blocks(batch, torch.Generator().manual_seed(3))[0]
    s = ids.shape[1]
    with torch.no_grad():
        hidden = cap(ids)
        embeds = model.get_input_embeddings()(blocks.block_ids) * 1.5
        masks = {AttentionKind(6, True): brute_force(blocks.anchors, blocks.keep, s, 4, window=6, causal=True)}
        pos = torch.cat([torch.arange(s).expand(2, s), blocks.block_positions], 1)
        out = d(hidden, embeds, pos, sdpa_attention, masks)
        logits = transform_logits(model.get_output_embeddings()(out), 0.5, 2.5)
    ce = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), blocks.labels.reshape(-1),
                                           reduction="none")
    w = blocks.weights.reshape(-1)
    assert w.sum() > 0
    torch.testing.assert_close(loss, (ce * w).sum() / w.sum(), rtol=1e-5, atol=1e-6)
    plain = DFlashObjective(make_drafter(model, layers=2), cap, objective.backend, cfg, torch.float32)
    assert not torch.allclose(plain(batch, torch.Generator().manual_seed(3)).loss, loss, atol=1e-3)


# ---------------------------------------------------------------------------- export


def test_training_keys_export_the_reference_fields_explicitly(target, tmp_path):
    d = make_drafter(target, block_size=4, layers=2, sliding_window=9, causal=False, output_multiplier=0.25,
                     final_logit_softcapping=20.0)
    out = save_drafter(d, tmp_path / "export", dtype="float32")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["layer_types"] == ["sliding_attention"] * 2 and cfg["sliding_window"] == 9
    assert cfg["use_sliding_window"] is True and cfg["is_causal"] is False and cfg["max_window_layers"] == 0
    assert cfg["dflash_config"]["output_multiplier"] == 0.25 and cfg["dflash_config"]["final_logit_softcapping"] == 20.0
    loaded = load_drafter(out)
    assert loaded.layer_attention == d.layer_attention == [AttentionKind(9, False)] * 2
    assert loaded.output_fields == d.output_fields == OutputFields(0.25, 20.0, 1.0)
    assert layer_kinds(loaded.config) == layer_kinds(d.config)

    default = json.loads((save_drafter(make_drafter(target), tmp_path / "plain", dtype="float32")
                          / "config.json").read_text())
    assert default["is_causal"] is False and default["layer_types"] == ["full_attention"]
    assert default["sliding_window"] is None and default["use_sliding_window"] is False
    assert not {"output_multiplier", "final_logit_softcapping"} & set(default["dflash_config"])

    causal = json.loads((save_drafter(make_drafter(target, sliding_window=9, causal=True), tmp_path / "c",
                                      dtype="float32") / "config.json").read_text())
    assert causal["is_causal"] is True


def test_mixed_causality_is_exported_by_leaving_is_causal_to_the_default(target, tmp_path):
    """Sliding layers causal and full ones not cannot be one is_causal value: the re-export leaves it out, and the
    reader's default gives those kinds back."""
    d = reference_format(make_drafter(target, layers=2), tmp_path / "a",
                         top={"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 8},
                         drop=("is_causal",))
    cfg = json.loads((save_drafter(d, tmp_path / "b", dtype="float32") / "config.json").read_text())
    assert "is_causal" not in cfg and cfg["use_sliding_window"] is True
    assert load_drafter(tmp_path / "b").layer_attention == [AttentionKind(8, True), AttentionKind(None, False)]
