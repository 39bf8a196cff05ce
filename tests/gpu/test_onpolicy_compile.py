"""GPU test (`pytest -m gpu`): the on-policy stage with the drafter and the target compiled, after a compiled
training run: its steps (a gradient-free pass at every anchor, then the chain's blocks) compile in the warm-up only."""

import pytest
import torch

from _gpu_helpers import (_fresh_dynamo_per_test, _gpu_config,  # noqa: F401 (the autouse Dynamo reset)
                          _steps_of_a_run_compiled_in_its_warm_up_only)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


MEMBERS = {"dflash": [], "dflash2": [], "domino": [], "dspark": ["dspark.markov_rank=16"],
           "lilicorr": ["lilicorr.head_hidden_size=64", "lilicorr.factor_dim=32", "lilicorr.head_num_heads=4"]}


@pytest.mark.parametrize("arch", sorted(MEMBERS))
def test_a_compiled_stage_never_recompiles_after_its_warm_up(tmp_path, tiny_target_dir, counting_jsonl, arch):
    from dflash_train.cli import main

    cfg = _gpu_config(tmp_path / "c.yaml", tiny_target_dir, counting_jsonl)
    common = ["drafter.compile=true", "target.compile=true", "data.token_budget=600", f"drafter.architecture={arch}",
              *MEMBERS[arch]]
    assert main(["train", str(cfg), *common, "--run-dir", str(tmp_path / "SFT"), "--max-steps", "10"]) == 0
    assert main(["train", str(cfg), *common, f"onpolicy.start_from={tmp_path / 'SFT'}", "--run-dir",
                 str(tmp_path / "R"), "--max-steps", "15"]) == 0
    steps = _steps_of_a_run_compiled_in_its_warm_up_only(tmp_path / "R")
    assert all("onpolicy_committed_loss" in r for r in steps)
