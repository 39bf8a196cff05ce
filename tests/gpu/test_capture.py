"""GPU tests (`pytest -m gpu`, on the device machine): the compiled target capture."""

import json
import math
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

from _gpu_helpers import _fresh_dynamo_per_test, _rel, _qwen3_target  # noqa: F401 (the autouse Dynamo reset)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]



def test_compiled_target_capture_matches_eager_and_new_lengths_never_recompile():
    """target.compile through inductor, 32 identical Qwen3 layers: the warm-up compiles 2 graphs for all
    of them (batch >= 2 and batch 1); the capture (early stop) and the full forward (with_final) equal
    the eager bf16 capture within bf16 rounding (no further from float32 than twice eager bf16 is) on
    random batch sizes and lengths; after the warm-up those captures compile nothing."""
    import copy

    from dflash_train.accel import compile as compile_layer
    from dflash_train.target.capture import TargetCapture

    compile_layer.watch_recompiles()
    torch._dynamo.reset()
    model = _qwen3_target()
    layer_ids = [1, 9, 17, 25]
    eager = TargetCapture.from_model(model, layer_ids)
    comp = TargetCapture.from_model(model, layer_ids, compile=True)
    ref32 = TargetCapture.from_model(copy.deepcopy(model).float(), layer_ids)
    info = comp.warm_up(length=300)
    assert info["target_compiled_graphs"] == 2 and info["target_recompiled_after_warmup"] == 0, info
    recompiles, graphs = compile_layer.recompiles(), compile_layer.graphs_compiled()
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # a true float32 reference
    try:
        g = torch.Generator().manual_seed(0)
        for b, s in ((3, 211), (1, 97), (4, 1500), (2, 640), (1, 333)):
            s += int(torch.randint(0, 40, (1,), generator=g))  # random lengths around these
            ids = torch.randint(0, 1000, (b, s), generator=g).cuda()
            for with_final in (False, True):
                got, got_final = comp.capture(ids, with_final=with_final)
                ref, ref_final = eager.capture(ids, with_final=with_final)
                exact, exact_final = ref32.capture(ids, with_final=with_final)
                assert got.dtype == ref.dtype == torch.bfloat16 and got.shape == ref.shape
                pairs = [(got, ref, exact)] + ([(got_final, ref_final, exact_final)] if with_final else [])
                for c, e, x in pairs:
                    c, e, x = c.float(), e.float(), x.float()
                    assert _rel(c, x) <= 2 * _rel(e, x) + 1e-3, (b, s, with_final, _rel(c, x), _rel(e, x))
                    assert _rel(c, e) < 5e-2, (b, s, with_final, _rel(c, e))
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.cuda.synchronize()
    assert compile_layer.recompiles() == recompiles and compile_layer.graphs_compiled() == graphs
    assert all("forward" not in vars(layer) for layer in model.model.layers)

