"""Drafters, inputs, configs and sync checks shared by the GPU tests."""

import json
import math
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch


@pytest.fixture(autouse=True)
def _fresh_dynamo_per_test():
    """Each GPU test starts from empty Dynamo caches, as a run starts in its own process: the variants earlier tests
    compiled (other drafters, other FP8 modes, 8B shapes) would otherwise count against a later run's recompile
    limit and guards in this one pytest process (seen: the FP8 end-to-end run failed after the numerics tests,
    and passed alone)."""
    torch._dynamo.reset()
    yield



def _drafter_and_inputs(block_size=16, s=300, batch=2, max_anchors=40, seed=0, layer_types=None, **keys):
    from transformers import Qwen3Config

    from dflash_train.architectures.dflash.model import DFlashDrafter
    from dflash_train.architectures.family.config import make_drafter_config
    from dflash_train.architectures.family.blocks import sample_anchors

    tcfg = Qwen3Config(hidden_size=256, intermediate_size=512, num_hidden_layers=8, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=64, vocab_size=1000)
    torch.manual_seed(seed)
    dcfg = make_drafter_config(tcfg, num_draft_layers=2, block_size=block_size, target_layer_ids=[1, 4], mask_token_id=5,
                               **keys)
    if layer_types:  # a reference drafter's mixed layers, is_causal left to the reader's default
        dcfg.layer_types = layer_types
        del dcfg.is_causal
    drafter = DFlashDrafter(dcfg).cuda()
    with torch.no_grad():  # peaked attention: near-uniform softmax makes q/k gradients pure rounding noise
        for layer in drafter.layers:
            layer.self_attn.q_norm.weight.fill_(3.0)
            layer.self_attn.k_norm.weight.fill_(3.0)
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(block_size * 2, s + 1, (batch,), generator=g)
    lengths[0] = s
    loss_mask = (torch.rand(batch, s, generator=g) < 0.8).long()
    anchors, keep = sample_anchors(loss_mask, lengths, block_size, max_anchors, g, multiple_of=128 // block_size)
    anchors, keep = anchors.cuda(), keep.cuda()
    n = anchors.shape[1]
    hidden = torch.randn(batch, s, 2 * 256, device="cuda", dtype=torch.bfloat16)
    block = torch.randn(batch, n * block_size, 256, device="cuda", dtype=torch.bfloat16)
    pos = torch.cat([torch.arange(s, device="cuda").expand(batch, s),
                     (anchors.unsqueeze(-1) + torch.arange(block_size, device="cuda")).view(batch, -1)], 1)
    return drafter, hidden, block, pos, anchors, keep, s



def _run(drafter, hidden, block, pos, anchors, keep, s, backend_name, dtype, compiled_layers=False):
    from dflash_train.architectures.family.backend import resolve_backend

    backend = resolve_backend(backend_name, torch.device("cuda"), 16)
    drafter.zero_grad(set_to_none=True)
    pad = -s % backend.context_multiple_of  # as the objective pads it: flex gets whole tiles, sdpa nothing
    if pad:
        hidden = torch.nn.functional.pad(hidden, (0, 0, 0, pad))
        pos = torch.cat([torch.arange(s + pad, device="cuda").expand(pos.shape[0], -1), pos[:, s:]], 1)
    mask = drafter.layer_masks(lambda kind: backend.build_mask(anchors, keep, s + pad, 16, kind))
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        out = drafter(hidden.to(dtype), block.to(dtype), pos, backend.attention, mask, compiled_layers=compiled_layers)
    live = keep.repeat_interleave(16, dim=1)
    # A random linear probe: mean(out**2) would be ~constant after the final RMSNorm (no gradient signal).
    probe = torch.randn(out.shape, generator=torch.Generator(device="cuda").manual_seed(1), device="cuda")
    loss = (out.float()[live] * probe[live]).sum()
    loss.backward()
    return out.detach().float()[live], {k: p.grad.float().clone() for k, p in drafter.named_parameters()}



def _rel(a, b):
    return float((a - b).norm() / b.norm().clamp_min(1e-12))



# The one synchronising call left in a colocated step is not ours: transformers' causal-mask code reads
# whether the position ids hold packed sequences (`find_packed_sequence_indices`, once per target forward
# without an attention mask). BENCHMARKS.md measures that it costs nothing at real shapes: steps run back
# to back take as long as steps that each wait for the GPU.
_SYNCS_NOT_OURS = (os.path.join("transformers", "masking_utils.py"),)



def _syncs_while(fn) -> list[warnings.WarningMessage]:
    """Run `fn` in CUDA's sync debug mode "warn"; return the warnings of synchronising calls, each with the
    Python file and line that made the call."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return [w for w in seen if "synchronizing CUDA operation" in str(w.message)]



def _gpu_config(path, target, data, **run):
    path.write_text(json.dumps({
        "target": {"path": str(target)},
        "drafter": {"num_draft_layers": 1, "block_size": 16, "attention_backend": "flex"},
        "data": {"train_files": [str(data)], "max_length": 256, "token_budget": 2048, "max_batch_size": 8},
        "objective": {"max_anchors": 32, "gamma": 7.0},
        "optim": {"lr": 5e-3, "epochs": 20, "warmup_ratio": 0.05},
        "run": {"device": "cuda", "log_every": 1, "save_every": 100, "progress_bar": False, "eval_every": 0, **run},
    }))
    return path



def _steps_of_a_run_compiled_in_its_warm_up_only(run_dir) -> list[dict]:
    """A finished run's step records, once its status and metrics show graphs compiled in the warm-up and none
    after it (neither the drafter's nor the target's); the loss fell."""
    status = json.loads((run_dir / "status.json").read_text())
    assert status["phase"] == "done" and status["drafter_compiled_graphs"] > 0, status
    assert status["target_recompiled_after_warmup"] == 0, status
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    assert steps[-1]["recompiles"] == steps[0]["recompiles"], [r["recompiles"] for r in steps]
    assert all(r["recompiles_after_warmup"] == 0 for r in steps), [r["recompiles_after_warmup"] for r in steps]
    assert steps[-1]["loss"] < steps[0]["loss"]
    return steps


EAGER_FLEX_AROUND_THE_SEAL = textwrap.dedent("""
    import json, torch
    from torch.nn.attention.flex_attention import flex_attention
    from dflash_train.accel import compile as compile_layer
    from dflash_train.architectures.family.backend import compiled_flex_attention
    def qkv():
        return [torch.randn(1, 2, 256, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3)]
    flex_attention(*qkv()).float().sum().backward()  # before the seal: runs (torch's one warning is spent)
    pending = flex_attention(*qkv()).float().sum()  # its backward comes after the seal
    compile_layer.seal()
    seen = {}
    def attempt(name, fn):
        try:
            fn()
            torch.cuda.synchronize()
            seen[name] = "ran"
        except compile_layer.UncompiledFlexAttention:
            seen[name] = "raised"
    attempt("eager forward", lambda: flex_attention(*qkv()))
    attempt("eager backward", lambda: pending.backward())
    attempt("compiled forward and backward", lambda: compiled_flex_attention()(*qkv()).float().sum().backward())
    print(json.dumps(seen))
""")



def _qwen3_target(layers=32, seed=0):
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(seed)
    cfg = Qwen3Config(hidden_size=256, intermediate_size=768, num_hidden_layers=layers, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=64, vocab_size=1000)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    return model.eval().requires_grad_(False)



# Per quantised matmul at most sqrt(2) * 2^-4 = 0.088 relative (both operands rounded by up to 2^-4); a branch
# (attention: q/k/v then o; MLP: gate/up then down) chains two: sqrt(2) * 0.088 = 0.125 (tests/unit/target/test_fp8_target.py).
# Deeper layers add their own rounding, independent of the earlier layers': the bound after L layers grows as
# sqrt(L). (The first GPU run, against a flat 0.125, measured 0.152 after 2 and 0.201 after 4 layers of the 8B
# shape; bf16 0.013 / 0.017.)
FP8_CAPTURE_BOUND_PER_LAYER = 0.125



# e4m3's unit roundoff (2^-4) over bf16's (2^-8): where the same graph rounds its matmul operands to e4m3 instead of
# bf16, its error grows by at most this factor.
E4M3_OVER_BF16 = 16
