"""Prepared datasets in training: fingerprint checks, the trainer's data source, token-budget batches
that resume exactly, and a short `dflash-train train` on a prepared directory."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import numpy as np
import pytest
import yaml

from dflash_train.cli import main
from dflash_train.config.load import config_from_dict
from dflash_train.data.dataset import batches_from, padding_fraction, plan_batches
from dflash_train.data.source import open_training_data
from dflash_train.target.capture import load_tokenizer


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, tiny_target_dir, counting_jsonl) -> Path:
    out = tmp_path_factory.mktemp("prep") / "counting"
    rc = main(["prepare", "--target", str(tiny_target_dir), "--data", str(counting_jsonl), "--out", str(out),
               "--block-size", "4", "--max-length", "256", "--val-fraction", "0.1", "--shard-rows", "16"])
    assert rc == 0
    return out


def _config(path: Path, target: Path, files: list, **data) -> Path:
    cfg = {
        "target": {"path": str(target)},
        "drafter": {"num_draft_layers": 1, "block_size": 4, "attention_backend": "sdpa"},
        "data": {"train_files": [str(f) for f in files], "max_length": 256, "token_budget": 1024,
                 "max_batch_size": 4, **data},
        "objective": {"max_anchors": 16, "gamma": 4.0},
        "optim": {"lr": 3e-3, "epochs": 2, "warmup_ratio": 0.05},
        "run": {"device": "cpu", "log_every": 1, "save_every": 3, "keep_last": 2, "progress_bar": False},
    }
    path.write_text(yaml.safe_dump(cfg))
    return path


def _cfg(target: Path, files: list, block_size: int = 4, **data):
    return config_from_dict({
        "target": {"path": str(target)},
        "drafter": {"block_size": block_size},
        "data": {"train_files": [str(f) for f in files], "max_length": 256, **data},
    })


def test_train_runs_on_a_prepared_dataset(prepared, tiny_target_dir, tmp_path, caplog):
    cfg = _config(tmp_path / "c.yaml", tiny_target_dir, [prepared])
    run = tmp_path / "R"
    with caplog.at_level(logging.INFO, logger="dflash_train"):
        assert main(["train", str(cfg), "--run-dir", str(run), "--max-steps", "5"]) == 0
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    validation = [r for r in records if r.get("kind") == "validation"]
    records = [r for r in records if r.get("kind") != "validation"]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5] and all(np.isfinite(r["loss"]) for r in records)
    # The prepared val split feeds validation at the last step; the best checkpoint is kept.
    assert [r["step"] for r in validation] == [5] and validation[0]["val_tau"] >= 1
    assert validation[0]["val_tau_walk"] >= 1
    assert (run / "checkpoints" / "best" / "trainer_state.json").is_file()
    log = (run / "train.log").read_text()
    assert f"{prepared} (train split: 56 rows" in log and "epoch 0: " in log and "padding" in log
    status = json.loads((run / "status.json").read_text())
    assert status["phase"] == "done" and 0 <= status["padding_fraction"] < 0.5
    state = json.loads((run / "checkpoints" / "step-00000005" / "trainer_state.json").read_text())
    assert state["epoch"] == 0 and state["batch_index"] == 5


def _open_training_data(cfg, tok):
    return open_training_data(cfg, tok, cfg.drafter.block_size)


def test_training_data_reads_prepared_rows_lazily_and_mixes_with_raw_files(prepared, tiny_target_dir, counting_jsonl):
    tok = load_tokenizer(tiny_target_dir)
    manifest = json.loads((prepared / "manifest.json").read_text())
    n_train = manifest["splits"]["train"]["rows"]
    data = _open_training_data(_cfg(tiny_target_dir, [prepared]), tok)
    assert len(data) == n_train == 64 - manifest["splits"]["val"]["rows"] and manifest["counts"]["kept"] == 64
    assert len(manifest["splits"]["train"]["shards"]) == 4  # 16 rows per shard
    for i in range(len(data)):
        ex = data.example(i)
        assert len(ex.input_ids) == data.lengths[i] and not ex.input_ids.flags.writeable  # a view of the mapped file
        assert tok.decode(ex.input_ids[ex.loss_mask.astype(bool)]).endswith("<|im_end|>\n")
    # a prepared directory and a raw file together; max_samples caps the total
    mixed = _open_training_data(_cfg(tiny_target_dir, [prepared, counting_jsonl]), tok)
    assert len(mixed) == n_train + 64
    assert np.array_equal(mixed.example(n_train + 3).input_ids, _open_training_data(
        _cfg(tiny_target_dir, [counting_jsonl]), tok).example(3).input_ids)
    assert len(_open_training_data(_cfg(tiny_target_dir, [prepared, counting_jsonl], max_samples=70), tok)) == 70
    # a shorter data.max_length truncates when read; a larger block size drops rows with too few supervised tokens
    short = _open_training_data(_cfg(tiny_target_dir, [prepared], max_length=64), tok)
    assert short.lengths.max() == 64 and len(short.example(0).input_ids) == 64
    strict = _open_training_data(_cfg(tiny_target_dir, [prepared], block_size=64), tok)
    assert 0 < len(strict) < n_train and strict.rejected["too few supervised tokens (block_size 64)"] == n_train - len(strict)


def _retokenized_copy(src: Path, dst: Path, *, special: str | None = None, template: str | None = None) -> Path:
    shutil.copytree(src, dst)
    tok = load_tokenizer(dst)
    if special:
        tok.add_special_tokens({"additional_special_tokens": [special]})
        tok.save_pretrained(dst)
    if template:
        (dst / "chat_template.jinja").write_text(template)
    return dst


def test_training_refuses_a_dataset_from_another_tokenizer(prepared, tiny_target_dir, tmp_path, capsys):
    other = _retokenized_copy(tiny_target_dir, tmp_path / "other-target", special="<|brand_new|>")
    manifest = json.loads((prepared / "manifest.json").read_text())
    theirs = load_tokenizer(other)
    from dflash_train.target.fingerprints import tokenizer_fingerprint

    assert tokenizer_fingerprint(theirs) != manifest["tokenizer_fingerprint"]
    cfg = _config(tmp_path / "c.yaml", other, [prepared])
    assert main(["train", str(cfg), "--run-dir", str(tmp_path / "R"), "--max-steps", "2"]) == 2
    err = capsys.readouterr().err
    assert "different tokenizer" in err and manifest["tokenizer_fingerprint"] in err
    assert tokenizer_fingerprint(theirs) in err and f"prepare --target {other}" in err
    assert not (tmp_path / "R").exists()  # a start refused for the user's data leaves no run behind


def test_training_refuses_a_dataset_from_another_chat_template(prepared, tiny_target_dir, tmp_path, capsys):
    template = (tiny_target_dir / "chat_template.jinja").read_text().replace("helpful AI assistant", "terse assistant")
    other = _retokenized_copy(tiny_target_dir, tmp_path / "other-template", template=template)
    cfg = _config(tmp_path / "c.yaml", other, [prepared])
    assert main(["train", str(cfg), "--run-dir", str(tmp_path / "R")]) == 2
    err = capsys.readouterr().err
    assert "different chat template" in err and "re-run" in err


@pytest.mark.parametrize("seed", range(4))
def test_batches_respect_both_limits_and_resume_exactly(seed):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(20, 700, size=257)
    budget, max_rows = 2048, 6
    stream = batches_from(lengths, budget, max_rows, seed)
    full = [next(stream) for _ in range(600)]  # several epochs
    epochs = sorted({e for e, _, _, _ in full})
    assert len(epochs) >= 3
    for e in epochs[:-1]:
        rows = [r for ee, _, _, r in full if ee == e]
        assert rows == plan_batches(lengths, budget, max_rows, seed, e)
        assert sorted(i for b in rows for i in b) == list(range(len(lengths)))  # each row once per epoch
    for _, _, _, b in full:
        assert len(b) <= max_rows and lengths[b].max() * len(b) <= budget
    assert padding_fraction(lengths, plan_batches(lengths, budget, max_rows, seed, 0)) < 0.1
    # Resume from any saved cursor (epoch, index of the next batch): the same batches as without a stop
    for k in (0, 1, 37, 90, len([f for f in full if f[0] == 0]), 333):
        e, i, n, _ = full[k]
        resumed = batches_from(lengths, budget, max_rows, seed, e, i)
        assert [next(resumed) for _ in range(100)] == full[k:k + 100]
        if i == n - 1:  # a cursor at the end of an epoch continues with the next one
            assert next(batches_from(lengths, budget, max_rows, seed, e, n)) == full[k + 1]
    end0 = [f for f in full if f[0] == 0][-1]
    assert next(batches_from(lengths, budget, max_rows, seed, 0, end0[2])) == full[end0[1] + 1]


def test_a_row_longer_than_the_token_budget_is_a_config_error():
    with pytest.raises(ValueError, match="token_budget"):
        plan_batches(np.array([10, 5000]), 4096, 8, 0, 0)
