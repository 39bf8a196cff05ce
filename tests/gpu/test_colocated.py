"""GPU tests (`pytest -m gpu`, on the device machine): colocated one-GPU runs."""

import json
import math
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

from _gpu_helpers import _fresh_dynamo_per_test, _run, _SYNCS_NOT_OURS, _syncs_while, _gpu_config, _qwen3_target  # noqa: F401 (the autouse Dynamo reset)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]



@pytest.mark.parametrize("architecture,compile_layers", [
    ("dflash", False), ("dflash", True), ("dflash2", True), ("dspark", True), ("domino", True), ("lilicorr", True)])
def test_a_colocated_step_never_waits_for_the_gpu(architecture, compile_layers):
    """After its first steps, a colocated training step of every architecture makes no synchronising CUDA call
    of its own: the batch goes over from pinned memory, anchors, blocks, counted rows (and what a member
    lays out beside them) are planned on the host copy, and a non-finite step is skipped on the device (fused
    AdamW's found_inf). CUDA's sync debug mode reports every wait with the line that caused it; the only ones
    allowed are in `_SYNCS_NOT_OURS`."""
    from dflash_train.architectures import architecture as registered
    from dflash_train.config.load import config_from_dict
    from dflash_train.target.capture import TargetCapture
    from dflash_train.data.batch import Batch
    from dflash_train.train.loop.step import TrainStep

    model = _qwen3_target(layers=4)
    cfg = config_from_dict({"drafter": {"architecture": architecture, "block_size": 16, "num_draft_layers": 2,
                                        "mask_token_id": 5},
                            "objective": {"max_anchors": 32}, "data": {"max_length": 512, "token_budget": 2048}})
    torch.manual_seed(0)
    arch = registered(architecture)
    drafter = arch.drafter_class(arch.config_for_run(model.config, cfg, [1, 2], 5)).cuda()
    if compile_layers:
        drafter.compile_layers()
    device = torch.device("cuda")
    step = TrainStep(drafter, TargetCapture.from_model(model, [1, 2]), arch.resolve_backend("flex", device, 16), cfg,
                     100, torch.bfloat16, device)
    g = torch.Generator().manual_seed(0)

    def host_batch(length):
        ids = torch.randint(10, 1000, (4, length), generator=g)
        mask = torch.ones_like(ids)
        mask[:, :20] = 0
        return Batch(ids, mask, torch.tensor([length, length - 7, length - 30, length - 64]))

    for n, length in enumerate((384, 320, 352)):  # compiles (a second length makes the sizes dynamic)
        step(host_batch(length).to(device), n)
    torch.cuda.synchronize()

    control = _syncs_while(lambda: torch.ones(1, device=device).item())
    assert len(control) == 1 and control[0].filename == __file__, "sync debug mode reported no .item()"

    results = []
    syncs = _syncs_while(lambda: results.extend(step(host_batch(length).to(device), n)
                                                for n, length in enumerate((352, 384, 320), start=3)))
    ours = [f"{w.filename}:{w.lineno}" for w in syncs if not w.filename.endswith(_SYNCS_NOT_OURS)]
    assert not ours, f"a training step waited for the GPU at: {ours}"
    assert len(syncs) <= len(results), "more than one wait per target forward in transformers' mask code"
    assert torch.isfinite(results[-1].loss) and step.skipped_steps == 0



def test_colocated_one_gpu_run_with_flex(tmp_path, tiny_target_dir, counting_jsonl):
    from dflash_train.cli import main

    cfg = _gpu_config(tmp_path / "c.yaml", tiny_target_dir, counting_jsonl, log_every=5, eval_every=500)
    assert main(["train", str(cfg), "--run-dir", str(tmp_path / "R"), "--max-steps", "40"]) == 0
    records = [json.loads(line) for line in (tmp_path / "R" / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["loss"] < records[0]["loss"]
    status = json.loads((tmp_path / "R" / "status.json").read_text())
    assert status["phase"] == "done" and status["backend"] == "flex"



def test_colocated_one_gpu_run_with_a_sliding_causal_softcapped_drafter(tmp_path, tiny_target_dir, counting_jsonl):
    """Training with every reference field the keys set, flex and the compiled drafter layers: the loss falls,
    and the export carries the fields and decodes losslessly."""
    from dflash_train.cli import main
    from dflash_train.infer.spec_decode import SpeculativeDecoder
    from dflash_train.architectures.io import load_drafter
    from dflash_train.target.capture import load_target_model

    cfg = _gpu_config(tmp_path / "c.yaml", tiny_target_dir, counting_jsonl, log_every=5)
    data = json.loads(cfg.read_text())
    data["drafter"].update(sliding_window=48, causal=True, final_logit_softcapping=15.0, output_multiplier=0.8,
                           compile=True)
    cfg.write_text(json.dumps(data))
    assert main(["train", str(cfg), "--run-dir", str(tmp_path / "R"), "--max-steps", "40"]) == 0
    records = [json.loads(line) for line in (tmp_path / "R" / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["loss"] < records[0]["loss"]
    exported = json.loads((tmp_path / "R" / "export" / "config.json").read_text())
    assert exported["sliding_window"] == 48 and exported["is_causal"] is True
    assert exported["dflash_config"]["final_logit_softcapping"] == 15.0
    target = load_target_model(tiny_target_dir, torch.float32, torch.device("cuda"))
    drafter = load_drafter(tmp_path / "R" / "export", device="cuda", dtype=torch.float32)
    dec = SpeculativeDecoder(target, drafter, stop_token_ids=[])
    prompt = list(range(100, 140))
    assert dec.generate_block(prompt, 32).tokens == dec.generate_target_only(prompt, 32).tokens



def test_preflight_refuses_a_plan_that_cannot_fit():
    from dflash_train.errors import UserError
    from dflash_train.train.plan.preflight import check_gpu

    free, _ = torch.cuda.mem_get_info(0)
    check_gpu(torch.device("cuda", 0), free // 2, 0, "a small plan")  # fits: no error
    with pytest.raises(UserError, match=r"rank 0 on cuda:0 needs about .* GiB .* only .* GiB are free"):
        check_gpu(torch.device("cuda", 0), free + 2**40, 0, "a huge plan")



def test_colocated_one_gpu_run_with_compiled_target(tmp_path, tiny_target_dir, counting_jsonl):
    """target.compile=true end to end: compiled in the warm-up (status.json says so), then no step compiles."""
    from dflash_train.cli import main

    cfg = _gpu_config(tmp_path / "c.yaml", tiny_target_dir, counting_jsonl)
    assert main(["train", str(cfg), "target.compile=true", "--run-dir", str(tmp_path / "R"), "--max-steps", "15"]) == 0
    status = json.loads((tmp_path / "R" / "status.json").read_text())
    # the plan has batches of several rows only (budget 2048, up to 8 rows): one graph for all layers
    assert status["phase"] == "done" and status["target_compiled_graphs"] == 1, status
    assert status["target_recompiled_after_warmup"] == 0
    records = [json.loads(line) for line in (tmp_path / "R" / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["recompiles"] == records[0]["recompiles"] and all(r["loss"] == r["loss"] for r in records)



def test_colocated_one_gpu_run_with_compiled_drafter_and_target(tmp_path, tiny_target_dir, counting_jsonl):
    """drafter.compile=true (and target.compile=true) end to end with validation: the warm-up compiles the
    training and validation graphs for batches of one row and of several, then no step compiles."""
    from dflash_train.cli import main

    cfg = _gpu_config(tmp_path / "c.yaml", tiny_target_dir, counting_jsonl, eval_every=5)
    assert main(["train", str(cfg), "drafter.compile=true", "target.compile=true", "data.token_budget=600",
                 "--run-dir", str(tmp_path / "R"), "--max-steps", "15"]) == 0
    status = json.loads((tmp_path / "R" / "status.json").read_text())
    assert status["phase"] == "done" and status["drafter_compiled_graphs"] > 0, status
    records = [json.loads(line) for line in (tmp_path / "R" / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["recompiles"] == records[0]["recompiles"] and all(r["loss"] == r["loss"] for r in records)
    assert records[-1]["loss"] < records[0]["loss"]

