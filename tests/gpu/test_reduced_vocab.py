"""GPU tests (`pytest -m gpu`, on the device machine): the reduced-vocabulary loss and run."""

import json
import math
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

from _gpu_helpers import _fresh_dynamo_per_test, _run, _rel, _gpu_config  # noqa: F401 (the autouse Dynamo reset)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]



@pytest.mark.parametrize("softcap,keep", [(None, False), (15.0, False), (15.0, True)])
def test_reduced_vocabulary_loss_with_a_trained_head_matches_float64(softcap, keep):
    """The compiled chunk math on the GPU (bf16 autocast, the head's float32 master weight, labels outside the
    vocabulary at -1), the head's weight gradient formed again or (keep) from the kept rows: loss, hits and both
    gradients against a float64 reference on the CPU."""
    from dflash_train.architectures.family.loss import CEOptions, chunked_weighted_ce

    g = torch.Generator().manual_seed(0)
    m, h, n = 3000, 256, 4096
    hidden = (torch.randn(m, h, generator=g) * 0.5).cuda().to(torch.bfloat16).requires_grad_()
    weight = (torch.randn(n, h, generator=g) * 0.05).cuda().requires_grad_()
    labels = torch.randint(0, n, (m,), generator=g)
    labels[torch.rand(m, generator=g) < 0.2] = -1
    w = torch.rand(m, generator=g) + 0.1
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = chunked_weighted_ce(hidden, weight, labels.cuda(), w.cuda(),
                                  CEOptions(1024, softcap=softcap, unscored=True, keep_grad_logits=keep))
    out.loss.backward()
    h64 = hidden.detach().double().cpu().requires_grad_()
    w64 = weight.detach().to(torch.bfloat16).double().cpu().requires_grad_()
    z = h64 @ w64.t()
    x = softcap * torch.tanh(z / softcap) if softcap else z
    keep = labels >= 0
    ce = torch.nn.functional.cross_entropy(x[keep], labels[keep], reduction="none")
    ref = (ce * w[keep].double()).sum() / w[keep].double().sum()
    ref.backward()
    assert float(out.loss) == pytest.approx(float(ref), rel=5e-3)
    assert _rel(hidden.grad.double().cpu(), h64.grad) < 2e-2
    assert _rel(weight.grad.double().cpu(), w64.grad) < 2e-2
    assert not out.correct.cpu()[~keep].any()



def test_colocated_one_gpu_run_with_a_reduced_vocabulary_compiles_nothing_after_the_warm_up(tmp_path, tiny_target_dir,
                                                                                           counting_jsonl):
    """drafter.draft_vocab_size with flex and the compiled drafter: the loss falls, no recompile after the warm-up
    (the trained head's backward runs the same compiled chunk function), the miss share is logged and the export
    decodes losslessly."""
    from dflash_train.cli import main
    from dflash_train.infer.spec_decode import SpeculativeDecoder
    from dflash_train.architectures.io import load_drafter
    from dflash_train.target.capture import load_target_model

    cfg = _gpu_config(tmp_path / "c.yaml", tiny_target_dir, counting_jsonl, log_every=5)
    data = json.loads(cfg.read_text())
    data["drafter"].update(draft_vocab_size=2000, compile=True)
    cfg.write_text(json.dumps(data))
    assert main(["train", str(cfg), "--run-dir", str(tmp_path / "R"), "--max-steps", "40"]) == 0
    records = [json.loads(line) for line in (tmp_path / "R" / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["loss"] < records[0]["loss"]
    assert all(r["recompiles_after_warmup"] == 0 and 0 <= r["label_outside_draft_vocab"] < 1 for r in records)
    assert json.loads((tmp_path / "R" / "export" / "config.json").read_text())["draft_vocab_size"] == 2000
    target = load_target_model(tiny_target_dir, torch.float32, torch.device("cuda"))
    drafter = load_drafter(tmp_path / "R" / "export", device="cuda", dtype=torch.float32)
    dec = SpeculativeDecoder(target, drafter, stop_token_ids=[])
    prompt = list(range(100, 140))
    assert dec.generate_block(prompt, 32).tokens == dec.generate_target_only(prompt, 32).tokens
    assert dec.generate_tree(prompt, 32, 8).tokens == dec.generate_target_only(prompt, 32).tokens

