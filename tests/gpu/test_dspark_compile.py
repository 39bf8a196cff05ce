"""GPU test (`pytest -m gpu`): a DSpark run with the drafter and the target compiled compiles in its warm-up only."""

import json

import pytest
import torch

from _gpu_helpers import (_fresh_dynamo_per_test, _gpu_config,  # noqa: F401 (the autouse Dynamo reset)
                          _steps_of_a_run_compiled_in_its_warm_up_only)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize("head", ["vanilla", "rnn"])
def test_a_compiled_dspark_run_never_recompiles_after_its_warm_up(tmp_path, tiny_target_dir, counting_jsonl, head):
    """drafter.compile=true and target.compile=true with flex attention and validation: the warm-up compiles the
    graphs for batches of one row and of several, the target run to its final norm for the L1 term; no step after
    it compiles again. The flat export decodes losslessly, drafting all B slots."""
    from dflash_train.architectures.io import load_drafter
    from dflash_train.cli import main
    from dflash_train.infer.spec_decode import SpeculativeDecoder
    from dflash_train.target.capture import load_target_model

    cfg = _gpu_config(tmp_path / "c.yaml", tiny_target_dir, counting_jsonl, eval_every=5)
    assert main(["train", str(cfg), "drafter.architecture=dspark", f"dspark.markov_head_type={head}",
                 "dspark.markov_rank=16", "drafter.compile=true", "target.compile=true", "data.token_budget=600",
                 "--run-dir", str(tmp_path / "R"), "--max-steps", "15"]) == 0
    steps = _steps_of_a_run_compiled_in_its_warm_up_only(tmp_path / "R")
    assert all(r["loss"] == r["loss"] and "l1_loss" in r and "confidence_loss" in r for r in steps)

    exported = json.loads((tmp_path / "R" / "export" / "config.json").read_text())
    assert exported["architectures"] == ["Qwen3DSparkModel"] and exported["markov_head_type"] == head
    target = load_target_model(tiny_target_dir, torch.float32, torch.device("cuda"))
    drafter = load_drafter(tmp_path / "R" / "export", device="cuda", dtype=torch.float32)
    assert drafter.num_drafts() == exported["block_size"]
    dec = SpeculativeDecoder(target, drafter, stop_token_ids=[])
    prompt = list(range(100, 140))
    assert dec.generate_block(prompt, 32).tokens == dec.generate_target_only(prompt, 32).tokens


def test_a_compiled_dpard_run_compiles_its_two_loss_chunks_without_a_recompile(tmp_path, tiny_target_dir,
                                                                                 counting_jsonl):
    """D-PARD's step runs the loss chunk without gradients (its slot weights), then with them: two compiled functions,
    so the warm-up logs no recompile of either, and nothing compiles after it."""
    from dflash_train.cli import main

    cfg = _gpu_config(tmp_path / "c.yaml", tiny_target_dir, counting_jsonl, eval_every=5)
    assert main(["train", str(cfg), "drafter.architecture=dspark", "dspark.loss=dpard", "dspark.markov_rank=16",
                 "drafter.compile=true", "target.compile=true", "data.token_budget=600",
                 "--run-dir", str(tmp_path / "R"), "--max-steps", "15"]) == 0
    steps = _steps_of_a_run_compiled_in_its_warm_up_only(tmp_path / "R")
    assert all(r["loss"] == r["loss"] for r in steps)
    log = (tmp_path / "R" / "train.log").read_text()
    assert [line for line in log.splitlines() if "recompiled" in line and "_chunk" in line] == []
