"""GPU tests (`pytest -m gpu`, on the device machine): flex attention against sdpa, and the eager-flex seal."""

import json
import math
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

from _gpu_helpers import _fresh_dynamo_per_test, _drafter_and_inputs, _run, _rel, EAGER_FLEX_AROUND_THE_SEAL  # noqa: F401 (the autouse Dynamo reset)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]



@pytest.mark.parametrize("seed", [0, 1, 2])
def test_flex_matches_sdpa_outputs_and_gradients(seed):
    """float32: flex and sdpa compute the same function (tight). bfloat16: flex's rounding error
    against the float32 result is no worse than sdpa's own (twice it at most)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    args = _drafter_and_inputs(seed=seed)
    ref_out, ref_grads = _run(*args, "sdpa", torch.float32)
    out, grads = _run(*args, "flex", torch.float32)
    assert _rel(out, ref_out) < 1e-4
    for k in ref_grads:
        assert _rel(grads[k], ref_grads[k]) < 1e-3, k
    s_out, s_grads = _run(*args, "sdpa", torch.bfloat16)
    f_out, f_grads = _run(*args, "flex", torch.bfloat16)
    assert _rel(f_out, ref_out) < 2 * _rel(s_out, ref_out) + 1e-3
    for k in ref_grads:
        assert _rel(f_grads[k], ref_grads[k]) < 2 * _rel(s_grads[k], ref_grads[k]) + 1e-2, k



@pytest.mark.parametrize("case", ["mixed", "window", "causal"])
def test_flex_matches_sdpa_with_sliding_and_causal_layers(case):
    """Compiled flex with the window / causal block masks and mask_mods computes what sdpa computes with the dense
    masks, per layer kind, outputs and gradients (float32); and the kinds change the result."""
    torch.backends.cuda.matmul.allow_tf32 = False
    keys = {"mixed": {"sliding_window": 40, "layer_types": ["sliding_attention", "full_attention"]},
            "window": {"sliding_window": 150}, "causal": {"causal": True}}[case]
    args = _drafter_and_inputs(seed=3, **keys)
    kinds = args[0].attention_kinds
    assert any(not k.is_default for k in kinds), kinds
    ref_out, ref_grads = _run(*args, "sdpa", torch.float32)
    out, grads = _run(*args, "flex", torch.float32)
    assert _rel(out, ref_out) < 1e-4
    for k in ref_grads:
        assert _rel(grads[k], ref_grads[k]) < 1e-3, k
    plain_out, _ = _run(*_drafter_and_inputs(seed=3), "flex", torch.float32)
    assert _rel(plain_out, ref_out) > 1e-2



def test_field_race_replayed_through_our_layer_has_zero_errors():
    """3 threads, cold Dynamo, simultaneous first calls, forward + backward with grad, 3 trials
    (the production crash: 2 of 2 trials failed on this card without serialisation)."""
    import threading

    from dflash_train.architectures.family.backend import compiled_flex_attention
    from dflash_train.architectures.family.mask import flex_block_mask

    errors = []
    for _ in range(3):
        torch._dynamo.reset()
        barrier = threading.Barrier(3)

        def worker(seed):
            try:
                g = torch.Generator(device="cuda").manual_seed(seed)
                q = torch.randn(2, 8, 256, 64, device="cuda", dtype=torch.bfloat16, generator=g, requires_grad=True)
                k = torch.randn(2, 2, 512, 64, device="cuda", dtype=torch.bfloat16, generator=g, requires_grad=True)
                anchors = torch.randint(0, 200, (2, 16), device="cuda").sort(1).values
                keep = torch.ones(2, 16, dtype=torch.bool, device="cuda")
                bm = flex_block_mask(anchors, keep, 256, 16)
                barrier.wait()
                out = compiled_flex_attention()(q, k, k, block_mask=bm, enable_gqa=True)
                out.float().sum().backward()
                torch.cuda.synchronize()
                assert torch.isfinite(q.grad).all()
            except BaseException as e:  # collect every failure of every thread
                errors.append(repr(e))

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert errors == []



def test_one_eager_flex_call_before_the_seal_and_another_after_raises_on_the_second():
    """torch warns about an eager flex_attention call once per process: the seal must not rely on that warning.
    After one eager call (forward and backward) before the seal, an eager forward and an eager backward after it
    raise; the compiled call runs."""
    proc = subprocess.run([sys.executable, "-c", EAGER_FLEX_AROUND_THE_SEAL], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {
        "eager forward": "raised", "eager backward": "raised", "compiled forward and backward": "ran"}



def test_an_eager_flex_call_in_a_gpu_warm_up_is_an_error(tiny_target_dir):
    """A drafter whose attention calls flex_attention eagerly (forward and backward with grad, bf16) fails the
    trainer's warm-up at its first attention call: the dense fallback never runs."""
    from pathlib import Path

    from torch.nn.attention.flex_attention import flex_attention

    from dflash_train.config.load import config_from_dict
    from dflash_train.accel import compile as compile_layer
    from dflash_train.architectures.family.backend import AttentionBackend
    from dflash_train.architectures.dflash.model import DFlashDrafter
    from dflash_train.architectures.family.config import make_drafter_config
    from dflash_train.target.capture import TargetCapture, load_target_model
    from dflash_train.train.loop.step import Batch, TrainStep
    from dflash_train.train.start.warmup import warm_up

    device = torch.device("cuda")
    model = load_target_model(tiny_target_dir, torch.bfloat16, device)
    cfg = config_from_dict({"drafter": {"block_size": 16, "num_draft_layers": 1}, "objective": {"max_anchors": 8},
                            "data": {"max_length": 256, "token_budget": 512}})
    drafter = DFlashDrafter(make_drafter_config(model.config, num_draft_layers=1, block_size=16,
                                                target_layer_ids=[1, 3], mask_token_id=5)).to(device)
    eager = AttentionBackend("flex", lambda q, k, v, mask: flex_attention(q, k, v, block_mask=mask, enable_gqa=True),
                             8, 128)
    from dflash_train.architectures.family.mask import flex_block_mask

    eager.build_mask = lambda anchors, keep, s, bs, kind: flex_block_mask(anchors, keep, s, bs, window=kind.sliding_window,
                                                                          causal=kind.causal)
    step = TrainStep(drafter, TargetCapture.from_model(model, [1, 3]), eager, cfg, 10, torch.bfloat16, device)
    ids = torch.randint(10, 1000, (2, 200), generator=torch.Generator().manual_seed(0))
    with pytest.raises(compile_layer.UncompiledFlexAttention, match="ran uncompiled after the warm-up began"):
        warm_up(step, Batch(ids, torch.ones_like(ids), torch.tensor([200, 180])).to(device), Path("unused"),
                kinds=(False, True))

