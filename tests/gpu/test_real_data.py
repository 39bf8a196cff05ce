"""GPU tests (`pytest -m gpu`, on the device machine): no recompiles on real variable-length data."""

import json
import math
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

from _gpu_helpers import _fresh_dynamo_per_test  # noqa: F401 (the autouse Dynamo reset)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]



@pytest.fixture(scope="module")
def real_data():
    """Real variable-length conversations for the SmolLM2 tokenizer (e.g. ShareGPT prompts answered by SmolLM2:
    `dflash-train regen --target smollm2 --data sharegpt --max-new-tokens 256 --out FILE`; 66-1,022 tokens at
    max_length 1024), named by DFLASH_TEST_REAL_DATA."""
    from pathlib import Path

    given = os.environ.get("DFLASH_TEST_REAL_DATA")
    if not given or not Path(given).is_file():
        pytest.skip(f"no real training data ({given or 'DFLASH_TEST_REAL_DATA is not set'}): set DFLASH_TEST_REAL_DATA")
    return Path(given)



@pytest.fixture(scope="module")
def qwen3_target_dir(tmp_path_factory, tokenizer_dir):
    """A random 8-layer Qwen3 (hidden 1024, 16 heads, 8 key/value heads of 128) with the SmolLM2 tokenizer."""
    import shutil

    from transformers import AutoModelForCausalLM, Qwen3Config

    from conftest import TOKENIZER_FILES

    out = tmp_path_factory.mktemp("qwen3-random")
    torch.manual_seed(0)
    cfg = Qwen3Config(hidden_size=1024, intermediate_size=3072, num_hidden_layers=8, num_attention_heads=16,
                      num_key_value_heads=8, head_dim=128, vocab_size=49152, max_position_embeddings=4096,
                      tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, out / name)
    return out



def test_real_variable_length_data_compiles_nothing_after_the_warm_up_nor_after_resume(tmp_path, qwen3_target_dir,
                                                                                        real_data):
    """A slice of real variable-length conversations (contexts 66-1,022 tokens, 1-16 rows, up to 512
    blocks a row) with both compiles on, across an epoch boundary: the plan's extreme batches compile nothing
    the first batch's graphs do not cover (no size threshold left in the compiled code), no step recompiles,
    and a --resume (a new process: a warm cache, Dynamo cold) compiles nothing after its warm-up either."""
    from _harness import run

    cfg = tmp_path / "c.yaml"
    cfg.write_text(json.dumps({
        "target": {"path": str(qwen3_target_dir), "compile": True},
        "drafter": {"num_draft_layers": 2, "block_size": 16, "attention_backend": "flex", "compile": True,
                    "mask_token_id": 16},
        "data": {"train_files": [str(real_data)], "max_length": 1024, "token_budget": 16384, "max_batch_size": 16,
                 "max_samples": 1000},
        "objective": {"max_anchors": 512, "gamma": 7.0},
        "optim": {"lr": 6e-4, "max_steps": 110, "warmup_ratio": 0.04},
        "run": {"device": "cuda", "log_every": 5, "save_every": 1000, "progress_bar": False, "eval_every": 0,
                "compile_cache_dir": str(tmp_path / "cache")},
    }))
    out, log = tmp_path / "R", tmp_path / "train.out"
    for args in (["--max-steps", "55", "--fresh-compile-cache"], ["--resume"]):
        assert run(["train", str(cfg), "--run-dir", str(out), *args], log, timeout=600) == 0, log.read_text()[-3000:]
        status = json.loads((out / "status.json").read_text())
        assert status["phase"] == "done", status
        assert status["warmup_extreme_batches"] >= 2 and status["extreme_batches_compiled_graphs"] == 0, status
        assert status["target_recompiled_after_warmup"] == 0 and status["recompiles_after_warmup"] == 0, status
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(5, 111, 5))
    assert all(r["recompiles_after_warmup"] == 0 for r in records), [r["recompiles_after_warmup"] for r in records]
    assert max(r["epoch"] for r in records) > 1.0  # past an epoch boundary: the next epoch's plan too
    text = (out / "train.log").read_text()
    assert "recompiled after the warm-up" not in text and text.count("warm-up done") == 2



def test_validation_on_real_data_compiles_nothing_after_the_warm_up(tmp_path, qwen3_target_dir, real_data):
    """Validation batches (held-out real conversations, their own sizes, no grad, eval mode) with both
    compiles and flex on: the warm-up runs validation's extreme batches as validation does, so the validations
    at steps 10, 20 and 30 (the last after the last metrics record) compile nothing after the seal."""
    import gzip

    from _harness import run

    with (gzip.open(real_data, "rt") if real_data.suffix == ".gz" else open(real_data)) as f:
        held_out = [line for _, line in zip(range(1300), f)][1000:]
    val = tmp_path / "val.jsonl"
    val.write_text("".join(held_out))
    cfg = tmp_path / "c.yaml"
    cfg.write_text(json.dumps({
        "target": {"path": str(qwen3_target_dir), "compile": True},
        "drafter": {"num_draft_layers": 2, "block_size": 16, "attention_backend": "flex", "compile": True,
                    "mask_token_id": 16},
        "data": {"train_files": [str(real_data)], "val_files": [str(val)], "max_length": 1024,
                 "token_budget": 16384, "max_batch_size": 16, "max_samples": 1000},
        "objective": {"max_anchors": 512, "gamma": 7.0},
        "optim": {"lr": 6e-4, "max_steps": 30, "warmup_ratio": 0.04},
        "run": {"device": "cuda", "log_every": 5, "save_every": 1000, "progress_bar": False, "eval_every": 10,
                "eval_batches": 8, "eval_prompts": 1, "eval_max_new_tokens": 32,
                "compile_cache_dir": str(tmp_path / "cache")},
    }))
    out, log = tmp_path / "R", tmp_path / "train.out"
    assert run(["train", str(cfg), "--run-dir", str(out)], log, timeout=600) == 0, log.read_text()[-3000:]
    status = json.loads((out / "status.json").read_text())
    assert status["phase"] == "done" and status["warmup_validation_batches"] >= 1, status
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r.get("kind") == "validation"] == [10, 20, 30]
    assert status["recompiles_after_warmup"] == 0, status
    text = (out / "train.log").read_text()
    assert "recompiled after the warm-up" not in text, text[-3000:]  # also the last validation's



def test_dflash2_on_real_data_compiles_nothing_after_the_warm_up_and_learns(tmp_path, qwen3_target_dir, real_data):
    """DFlash2 with both compiles and flex on real variable-length data: the convolutions compile inside the
    layers' graphs, the warm-up covers the plan, no step recompiles, the loss falls and the export reloads as a
    DFlash2 drafter."""
    from _harness import run

    from dflash_train.architectures.dflash2.model import DFlash2Drafter
    from dflash_train.architectures.io import load_drafter

    cfg = tmp_path / "c.yaml"
    cfg.write_text(json.dumps({
        "target": {"path": str(qwen3_target_dir), "compile": True},
        "drafter": {"architecture": "dflash2", "num_draft_layers": 2, "block_size": 16, "attention_backend": "flex",
                    "compile": True, "mask_token_id": 16},
        "data": {"train_files": [str(real_data)], "max_length": 1024, "token_budget": 16384, "max_batch_size": 16,
                 "max_samples": 600},
        "objective": {"max_anchors": 512},
        "optim": {"lr": 6e-4, "max_steps": 40, "warmup_ratio": 0.04},
        "run": {"device": "cuda", "log_every": 5, "save_every": 1000, "progress_bar": False, "eval_every": 0,
                "compile_cache_dir": str(tmp_path / "cache")},
    }))
    out, log = tmp_path / "R", tmp_path / "train.out"
    assert run(["train", str(cfg), "--run-dir", str(out)], log, timeout=600) == 0, log.read_text()[-3000:]
    status = json.loads((out / "status.json").read_text())
    assert status["phase"] == "done" and status["recompiles_after_warmup"] == 0, status
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(r["loss"] == r["loss"] for r in records) and records[-1]["loss"] < records[0]["loss"], records
    assert isinstance(load_drafter(out / "export"), DFlash2Drafter)

