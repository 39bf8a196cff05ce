"""GPU test (`pytest -m gpu`): a Domino run with the drafter and the target compiled compiles in its warm-up only."""

import json

import pytest
import torch

from _gpu_helpers import (_fresh_dynamo_per_test, _gpu_config,  # noqa: F401 (the autouse Dynamo reset)
                          _steps_of_a_run_compiled_in_its_warm_up_only)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_a_compiled_domino_run_never_recompiles_after_its_warm_up(tmp_path, tiny_target_dir, counting_jsonl):
    """drafter.compile=true and target.compile=true with flex attention and validation: the warm-up compiles the
    graphs for batches of one row and of several; no step after it compiles again (the GRU and the correction run
    between the compiled layers, in every step alike). The export is SGLang's layout and decodes losslessly."""
    from dflash_train.architectures.io import load_drafter
    from dflash_train.cli import main
    from dflash_train.infer.spec_decode import SpeculativeDecoder
    from dflash_train.target.capture import load_target_model

    cfg = _gpu_config(tmp_path / "c.yaml", tiny_target_dir, counting_jsonl, eval_every=5)
    assert main(["train", str(cfg), "drafter.architecture=domino", "domino.gru_hidden_dim=64", "domino.emb_dim=32",
                 "drafter.compile=true", "target.compile=true", "data.token_budget=600",
                 "--run-dir", str(tmp_path / "R"), "--max-steps", "15"]) == 0
    steps = _steps_of_a_run_compiled_in_its_warm_up_only(tmp_path / "R")
    assert all(r["loss"] == r["loss"] and "final_loss" in r and "base_loss" in r for r in steps)

    exported = json.loads((tmp_path / "R" / "export" / "config.json").read_text())
    assert exported["architectures"] == ["DFlashDraftModel"] and exported["dflash_config"]["projector_type"] == "domino"
    assert exported["dtype"] == "bfloat16"  # what SGLang's Domino path requires
    target = load_target_model(tiny_target_dir, torch.float32, torch.device("cuda"))
    drafter = load_drafter(tmp_path / "R" / "export", device="cuda", dtype=torch.float32)
    dec = SpeculativeDecoder(target, drafter, stop_token_ids=[])
    prompt = list(range(100, 140))
    assert dec.generate_block(prompt, 32).tokens == dec.generate_target_only(prompt, 32).tokens
