"""GPU test (`pytest -m gpu`): LiLiCorr runs, plain and "+conv", with the drafter and the target compiled, compile in
their warm-ups only; the exports are the engines' layout and decode losslessly."""

import json

import pytest
import torch

from _gpu_helpers import (_fresh_dynamo_per_test, _gpu_config,  # noqa: F401 (the autouse Dynamo reset)
                          _steps_of_a_run_compiled_in_its_warm_up_only)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize("conv,backbone_gradient", [(False, True), (True, True), (False, False)])
def test_a_compiled_lilicorr_run_never_recompiles_after_its_warm_up(tmp_path, tiny_target_dir, counting_jsonl, conv,
                                                                    backbone_gradient, monkeypatch):
    """drafter.compile=true and target.compile=true with flex attention and validation: the head's vectors compile
    as one graph of one padded chunk shape (chunked and recomputed in the backward), so no step after the warm-up
    compiles again whatever its number of blocks; with conv the convolution-wrapped layers compile under their own
    names; with lilicorr.backbone_gradient=false the head's graph reads detached inputs. Chunks of 4 blocks: steps
    run full chunks and, most of them, a padded last one."""
    from dflash_train.architectures.io import load_drafter
    from dflash_train.architectures.lilicorr import head as lilicorr_head
    from dflash_train.cli import main
    from dflash_train.infer.spec_decode import SpeculativeDecoder
    from dflash_train.target.capture import load_target_model

    monkeypatch.setattr(lilicorr_head, "CHUNK_NODES", 4 * 15 * 8)  # block 16: 15 slots of k = 8 candidates
    monkeypatch.setattr(lilicorr_head, "MAX_CHUNKS", 10**6)  # the least chunk whatever the run's largest batch
    cfg = _gpu_config(tmp_path / "c.yaml", tiny_target_dir, counting_jsonl, eval_every=5)
    assert main(["train", str(cfg), "drafter.architecture=lilicorr", "lilicorr.head_hidden_size=64",
                 "lilicorr.factor_dim=32", "lilicorr.head_num_heads=4", f"lilicorr.conv={str(conv).lower()}",
                 f"lilicorr.backbone_gradient={str(backbone_gradient).lower()}",
                 "drafter.compile=true", "target.compile=true", "data.token_budget=600",
                 "--run-dir", str(tmp_path / "R"), "--max-steps", "15"]) == 0
    steps = _steps_of_a_run_compiled_in_its_warm_up_only(tmp_path / "R")
    assert all(r["loss"] == r["loss"] and "lattice_ce_loss" in r for r in steps)

    exported = json.loads((tmp_path / "R" / "export" / "config.json").read_text())
    assert exported["architectures"] == ["LiLiCorrDraftModel"]
    assert ("conv_kernel_size" in exported["dflash_config"]) == conv
    target = load_target_model(tiny_target_dir, torch.float32, torch.device("cuda"))
    drafter = load_drafter(tmp_path / "R" / "export", device="cuda", dtype=torch.float32)
    dec = SpeculativeDecoder(target, drafter, stop_token_ids=[])
    prompt = list(range(100, 140))
    assert dec.generate_block(prompt, 32).tokens == dec.generate_target_only(prompt, 32).tokens
