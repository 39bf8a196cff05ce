"""DFlash: target capture, the drafter's reference semantics, one training step, and the export format."""

import json

import pytest
import torch
from safetensors import safe_open

from dflash_train.config.load import config_from_dict
from dflash_train.data.batch import Batch
from dflash_train.architectures.family.backend import resolve_backend
from dflash_train.architectures.drafter import default_target_layer_ids
from dflash_train.architectures.attention import sdpa_attention
from dflash_train.architectures.dflash.model import DFlashDrafter
from dflash_train.architectures.family.config import make_drafter_config
from dflash_train.architectures.io import load_drafter, save_drafter
from dflash_train.target.capture import TargetCapture, load_target_model
from dflash_train.train.loop.step import TrainStep


def test_default_layer_ids_follow_the_reference_rule():
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_target_layer_ids(30, 5) == [1, 8, 14, 20, 27]
    assert default_target_layer_ids(30, 1) == [15]
    assert default_target_layer_ids(64, 5) == [1, 16, 31, 46, 61]


@pytest.fixture()
def tiny_model(tiny_target_dir):
    return load_target_model(tiny_target_dir, torch.float32, torch.device("cpu"))


def test_capture_equals_hf_hidden_states_and_skips_later_layers(tiny_target_dir, tiny_model):
    ids = torch.randint(3, 49152, (2, 23))
    with torch.no_grad():
        full = tiny_model(ids, output_hidden_states=True).hidden_states
    reference = torch.cat([full[i + 1] for i in [1, 3]], dim=-1)
    norm_calls = []
    model = load_target_model(tiny_target_dir, torch.float32, torch.device("cpu"))
    later = model.model.layers[4]
    calls = []
    later.register_forward_hook(lambda *a: calls.append(1))
    cap = TargetCapture.from_model(model, [1, 3])
    head_calls = []
    cap.lm_head.register_forward_hook(lambda *a: head_calls.append(1))
    model.model.norm.register_forward_hook(lambda *a: norm_calls.append(1))
    out = cap(ids)
    assert out.shape == (2, 23, 2 * 64)
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-5)
    assert not calls and not head_calls and not norm_calls and len(model.model.layers) == 6  # whole, but cut short at run time


def test_capture_ignores_right_padding(tiny_model):
    cap = TargetCapture.from_model(tiny_model, [0, 2])
    ids = torch.randint(3, 49152, (1, 17))
    padded = torch.cat([ids, torch.full((1, 5), 2)], dim=1)
    torch.testing.assert_close(cap(padded)[:, :17], cap(ids), rtol=1e-5, atol=1e-6)


def _drafter(tiny_model, block_size=4, layers=2, ids=(1, 3), seed=0):
    torch.manual_seed(seed)
    cfg = make_drafter_config(tiny_model.config, num_draft_layers=layers, block_size=block_size,
                              target_layer_ids=list(ids), mask_token_id=16)
    return DFlashDrafter(cfg)


def test_drafter_config_derived_from_target(tiny_model):
    d = _drafter(tiny_model)
    c = d.config
    assert (c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.intermediate_size, c.vocab_size) == \
        (64, 4, 2, 16, 128, 49152)
    assert c.num_target_layers == 6 and c.num_hidden_layers == 2
    assert d.fc.weight.shape == (64, 128)


def _manual_layer(layer, x, ctx, pos_q, pos_k, rotary, mask):
    """An independent float64 implementation of one drafter layer, straight from the spec."""
    a = layer.self_attn
    def rms(t, w, eps=1e-6):
        return w * (t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + eps))
    def rope(t, pos):
        freqs = pos[..., None].double() * rotary.inv_freq.double()
        emb = torch.cat([freqs, freqs], -1)
        cos, sin = emb.cos()[:, None], emb.sin()[:, None]
        t1, t2 = t.chunk(2, -1)
        return t * cos + torch.cat([-t2, t1], -1) * sin
    b, q_len, _ = x.shape
    h = rms(x, layer.input_layernorm.weight)
    q = rms((h @ a.q_proj.weight.T).view(b, q_len, a.num_heads, a.head_dim), a.q_norm.weight).transpose(1, 2)
    kv_in = torch.cat([ctx, h], 1)
    k = rms((kv_in @ a.k_proj.weight.T).view(b, -1, a.num_kv_heads, a.head_dim), a.k_norm.weight).transpose(1, 2)
    v = (kv_in @ a.v_proj.weight.T).view(b, -1, a.num_kv_heads, a.head_dim).transpose(1, 2)
    q, k = rope(q, pos_q), rope(k, pos_k)
    rep = a.num_heads // a.num_kv_heads
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = (q @ k.transpose(-1, -2)) / a.head_dim ** 0.5
    scores = scores.masked_fill(~mask, float("-inf"))
    out = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, q_len, -1) @ a.o_proj.weight.T
    x = x + out
    m = layer.mlp
    h = rms(x, layer.post_attention_layernorm.weight)
    return x + (torch.nn.functional.silu(h @ m.gate_proj.weight.T) * (h @ m.up_proj.weight.T)) @ m.down_proj.weight.T


def test_drafter_forward_matches_an_independent_float64_reference(tiny_model):
    from dflash_train.architectures.family.mask import dense_mask

    d = _drafter(tiny_model).double()
    with torch.no_grad():
        for p in d.parameters():  # non-trivial norms too
            p.add_(torch.randn_like(p) * 0.05)
    s, bs = 12, 4
    hidden = torch.randn(1, s, 128, dtype=torch.float64)
    anchors, keep = torch.tensor([[2, 7]]), torch.tensor([[True, True]])
    block = torch.randn(1, 8, 64, dtype=torch.float64)
    block_pos = (anchors.unsqueeze(-1) + torch.arange(bs)).view(1, -1)
    pos = torch.cat([torch.arange(s).view(1, -1), block_pos], 1)
    mask = dense_mask(anchors, keep, s, bs)
    out = d(hidden, block, pos, sdpa_attention, mask)
    ctx = d.hidden_norm.weight * (lambda t: t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6))(hidden @ d.fc.weight.T)
    x = block
    for layer in d.layers:
        x = _manual_layer(layer, x, ctx, block_pos, pos, d.rotary, mask)
    ref = d.norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    # RMSNorm and RoPE compute in float32 inside (as the reference does), hence float32-level tolerance.
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


def test_one_step_changes_only_the_drafter(tiny_target_dir):
    cfg = config_from_dict({"drafter": {"block_size": 4, "num_draft_layers": 2},
                            "objective": {"max_anchors": 8}, "data": {"max_length": 64, "token_budget": 256}})
    model = load_target_model(tiny_target_dir, torch.float32, torch.device("cpu"))
    target_before = {k: v.clone() for k, v in model.state_dict().items()}
    cap = TargetCapture.from_model(model, [1, 3])
    d = _drafter(model)
    drafter_before = {k: v.clone() for k, v in d.state_dict().items()}
    step = TrainStep(d, cap, resolve_backend("sdpa", torch.device("cpu"), 4), cfg, 10, torch.float32, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 49152, (2, 40), generator=g)
    batch = Batch(ids, torch.ones_like(ids), torch.tensor([40, 33]))
    stats = step(batch, 0)
    assert torch.isfinite(stats.loss) and stats.counted_per_slot[0] == 0 and stats.counted_per_slot[1:].sum() > 0
    for k, v in model.state_dict().items():  # includes the shared embeddings / lm_head
        assert torch.equal(v, target_before[k]), k
    assert all(p.grad is None for p in model.parameters())
    changed = [k for k, v in d.state_dict().items() if not torch.equal(v, drafter_before[k])]
    assert set(changed) == set(drafter_before), set(drafter_before) - set(changed)


def test_a_non_finite_step_changes_nothing_and_a_run_of_them_stops_training(tiny_target_dir):
    """The skip happens on the device (fused AdamW's found_inf): a step with a non-finite gradient leaves the
    weights, the AdamW moments and its step count as they were and is counted; good steps in between end a run
    of bad ones; max_bad_steps bad steps in a row raise."""
    cfg = config_from_dict({"drafter": {"block_size": 4, "num_draft_layers": 1},
                            "objective": {"max_anchors": 8}, "data": {"max_length": 64, "token_budget": 256}})
    model = load_target_model(tiny_target_dir, torch.float32, torch.device("cpu"))
    d = _drafter(model, layers=1)
    step = TrainStep(d, TargetCapture.from_model(model, [1, 3]), resolve_backend("sdpa", torch.device("cpu"), 4), cfg,
                     100, torch.float32, torch.device("cpu"))
    ids = torch.randint(3, 49152, (2, 40), generator=torch.Generator().manual_seed(0))
    batch = Batch(ids, torch.ones_like(ids), torch.tensor([40, 33]))
    step(batch, 0)

    def snapshot():
        opt = {id(p): {k: v.clone() for k, v in s.items()} for p, s in step.optimizer.state.items()}
        return {k: v.clone() for k, v in d.state_dict().items()}, opt

    poison = d.layers[0].mlp.down_proj.weight
    n = 1
    for run_of_bad in (1, 2, step.max_bad_steps - 1):
        handle = poison.register_hook(lambda g: g * float("nan"))
        for _ in range(run_of_bad):
            weights, moments = snapshot()
            stats = step(batch, n)
            n += 1
            assert not torch.isfinite(stats.grad_norm)
            assert all(torch.equal(v, weights[k]) for k, v in d.state_dict().items())
            assert all(torch.equal(v, moments[id(p)][k]) for p, s in step.optimizer.state.items() for k, v in s.items())
        handle.remove()
        weights, _ = snapshot()
        step(batch, n)  # a good step: updates, and ends the run
        n += 1
        assert not torch.equal(poison, weights["layers.0.mlp.down_proj.weight"])
    assert step.skipped_steps == 1 + 2 + step.max_bad_steps - 1
    assert int(step.optimizer.state[poison]["step"]) == n - step.skipped_steps

    poison.register_hook(lambda g: g * float("nan"))
    for k in range(step.max_bad_steps - 1):
        step(batch, n + k)
    with pytest.raises(FloatingPointError, match=f"{step.max_bad_steps} steps in a row"):
        step(batch, n + step.max_bad_steps - 1)


REFERENCE_TENSORS = (
    [f"layers.{i}.self_attn.{p}_proj.weight" for i in range(2) for p in "qkvo"]
    + [f"layers.{i}.self_attn.{p}_norm.weight" for i in range(2) for p in "qk"]
    + [f"layers.{i}.mlp.{p}_proj.weight" for i in range(2) for p in ("gate", "up", "down")]
    + [f"layers.{i}.{p}_layernorm.weight" for i in range(2) for p in ("input", "post_attention")]
    + ["fc.weight", "hidden_norm.weight", "norm.weight"]
)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_export_round_trip_is_identical_and_in_reference_format(tiny_model, tmp_path, dtype):
    d = _drafter(tiny_model)
    out = save_drafter(d, tmp_path / "export", dtype=dtype)
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert sorted(f.keys()) == sorted(REFERENCE_TENSORS)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["model_type"] == "qwen3"
    assert cfg["block_size"] == 4 and cfg["num_hidden_layers"] == 2 and cfg["num_target_layers"] == 6
    assert cfg["dflash_config"]["mask_token_id"] == 16 and cfg["dflash_config"]["target_layer_ids"] == [1, 3]
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                "rope_theta", "rms_norm_eps", "vocab_size", "layer_types", "tie_word_embeddings"):
        assert key in cfg, key
    assert cfg["dtype"] == dtype
    loaded = load_drafter(out)
    torch_dtype = getattr(torch, dtype)
    original = d.to(torch_dtype)
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), original.state_dict().values()))
    hidden = torch.randn(1, 10, 128).to(torch_dtype)
    block = torch.randn(1, 4, 64).to(torch_dtype)
    pos = torch.cat([torch.arange(10), torch.arange(5, 9)]).view(1, -1)
    with torch.no_grad():
        assert torch.equal(loaded(hidden, block, pos, sdpa_attention, None), original(hidden, block, pos, sdpa_attention, None))


def test_load_is_strict(tiny_model, tmp_path):
    from safetensors.torch import load_file, save_file

    out = save_drafter(_drafter(tiny_model), tmp_path / "export", dtype="float32")
    tensors = load_file(str(out / "model.safetensors"))
    tensors["lm_head.weight"] = torch.zeros(3, 3)
    save_file(tensors, str(out / "model.safetensors"))
    with pytest.raises(ValueError, match="unexpected tensors.*lm_head.weight"):
        load_drafter(out)
    del tensors["lm_head.weight"], tensors["fc.weight"]
    save_file(tensors, str(out / "model.safetensors"))
    with pytest.raises(ValueError, match="missing tensors.*fc.weight"):
        load_drafter(out)
    (out / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ValueError, match="not a DFlash drafter config"):
        load_drafter(out)


def test_rope_tables_stay_float32_when_the_drafter_is_cast(tiny_model):
    d = _drafter(tiny_model).to(torch.bfloat16)
    assert d.rotary.inv_freq.dtype == torch.float32


def test_not_kept_blocks_give_zero_output_and_finite_gradients():
    from dflash_train.architectures.family.mask import dense_mask

    torch.manual_seed(0)
    q = torch.randn(1, 2, 8, 4, requires_grad=True)
    k = torch.randn(1, 2, 12, 4, requires_grad=True)
    v = torch.randn(1, 2, 12, 4, requires_grad=True)
    mask = dense_mask(torch.tensor([[2, 0]]), torch.tensor([[True, False]]), 4, 4)
    out = sdpa_attention(q, k, v, mask)
    assert torch.equal(out[:, :, 4:], torch.zeros_like(out[:, :, 4:]))
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))
    assert torch.equal(q.grad[:, :, 4:], torch.zeros_like(q.grad[:, :, 4:]))


def test_a_narrower_drafter_trains_exports_and_reloads_with_its_shape(tiny_target_dir, tmp_path):
    """drafter.intermediate_size / num_attention_heads / num_key_value_heads / head_dim override the
    target's layer shape; the hidden size stays the target's."""
    from dflash_train.errors import ConfigError

    model = load_target_model(tiny_target_dir, torch.float32, torch.device("cpu"))
    dcfg = make_drafter_config(model.config, num_draft_layers=1, block_size=4, target_layer_ids=[1, 3],
                               mask_token_id=16, intermediate_size=48, num_attention_heads=2, num_key_value_heads=1,
                               head_dim=8)
    assert (dcfg.hidden_size, dcfg.intermediate_size, dcfg.num_attention_heads, dcfg.num_key_value_heads,
            dcfg.head_dim) == (model.config.hidden_size, 48, 2, 1, 8)
    torch.manual_seed(0)
    d = DFlashDrafter(dcfg)
    assert d.layers[0].self_attn.q_proj.weight.shape == (16, model.config.hidden_size)
    assert d.layers[0].mlp.up_proj.weight.shape == (48, model.config.hidden_size)
    cfg = config_from_dict({"drafter": {"block_size": 4, "num_draft_layers": 1}, "objective": {"max_anchors": 8},
                            "data": {"max_length": 64, "token_budget": 256}})
    step = TrainStep(d, TargetCapture.from_model(model, [1, 3]), resolve_backend("sdpa", torch.device("cpu"), 4), cfg,
                     10, torch.float32, torch.device("cpu"))
    ids = torch.randint(3, 49152, (2, 40), generator=torch.Generator().manual_seed(0))
    stats = step(Batch(ids, torch.ones_like(ids), torch.tensor([40, 33])), 0)
    assert torch.isfinite(stats.loss)
    save_drafter(d, tmp_path / "x", dtype="float32")
    exported = json.loads((tmp_path / "x" / "config.json").read_text())
    assert (exported["intermediate_size"], exported["num_attention_heads"], exported["num_key_value_heads"],
            exported["head_dim"]) == (48, 2, 1, 8)
    back = load_drafter(tmp_path / "x")
    for (k, v), (k2, v2) in zip(d.state_dict().items(), back.state_dict().items()):
        assert k == k2 and torch.equal(v, v2), k
    with pytest.raises(ValueError, match="3 query heads cannot share 2 key/value heads"):
        make_drafter_config(model.config, num_draft_layers=1, block_size=4, target_layer_ids=[1], mask_token_id=16,
                            num_attention_heads=3, num_key_value_heads=2)
    with pytest.raises(ConfigError, match="drafter.num_key_value_heads"):
        config_from_dict({"drafter": {"num_attention_heads": 6, "num_key_value_heads": 4}})
    with pytest.raises(ConfigError, match="drafter.intermediate_size"):
        config_from_dict({"drafter": {"intermediate_size": 0}})
