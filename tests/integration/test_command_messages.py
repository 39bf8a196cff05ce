"""What the commands say to a newcomer: the version, and a flag and an override that set the same key."""

from __future__ import annotations

import importlib.metadata as md
import subprocess
import sys

import yaml

from _harness import ENV, write_config

import dflash_train
from dflash_train.cli import main
from dflash_train.train.start.directory_admission import admit_start


def test_version_names_the_package_torch_and_transformers():
    out = subprocess.run([sys.executable, "-m", "dflash_train", "--version"], capture_output=True, text=True, env=ENV,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    line = out.stdout.strip()
    assert line.startswith(f"dflash-train {dflash_train.__version__} ("), line
    assert f"torch {md.version('torch')}" in line and f"transformers {md.version('transformers')}" in line, line


def test_max_steps_and_an_override_of_the_same_key_are_refused_unless_they_agree(tmp_path, tiny_target_dir,
                                                                                counting_jsonl, capsys):
    cfg = write_config(tmp_path / "c.yaml", tiny_target_dir, counting_jsonl, optim__max_steps=3)
    run = tmp_path / "R"
    assert main(["train", str(cfg), "--max-steps", "4", "optim.max_steps=7", "--run-dir", str(run)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "error: --max-steps 4 and the override optim.max_steps=7 both set optim.max_steps: give one of them"
    assert not run.exists()
    agreed = admit_start(str(cfg), ["optim.max_steps=4"], run, resume=False, max_steps=4)
    assert agreed.cfg.optim.max_steps == 4
    # the flag is the command line's word over the file's 3, as an override would be
    assert admit_start(str(cfg), [], run, resume=False, max_steps=5).cfg.optim.max_steps == 5
    assert yaml.safe_load(cfg.read_text())["optim"]["max_steps"] == 3 and not run.exists()


def _cli(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dflash_train", *args], capture_output=True, text=True, env=ENV,
                          timeout=300)


def _one_error(out: subprocess.CompletedProcess) -> str:
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-3000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, out.stderr
    return errors[0]


def test_more_local_ranks_than_gpus_are_refused_before_any_rank_starts(tmp_path, tiny_target_dir, counting_jsonl):
    import torch

    gpus = torch.cuda.device_count()
    nproc = max(2, gpus + 1)
    cfg = write_config(tmp_path / "c.yaml", tiny_target_dir, counting_jsonl)
    run = tmp_path / "R"
    line = _one_error(_cli(["train", str(cfg), "--run-dir", str(run), "--nproc", str(nproc), "run.device=cuda"]))
    said = f"one rank per GPU, and {gpus} GPU(s) are visible" if gpus else "run.device is cuda, but no GPU is visible"
    assert line.startswith(f"error: --nproc {nproc}: {said}"), line
    assert not run.exists()
    if not gpus:  # one process: the same mistake is one line too
        line = _one_error(_cli(["train", str(cfg), "--run-dir", str(run), "run.device=cuda"]))
        assert "no CUDA device is visible" in line and not run.exists(), line


def test_prepare_names_a_missing_input_before_it_reads_the_target(tmp_path, counting_jsonl):
    no_model = tmp_path / "no-model"
    no_model.mkdir()
    missing = tmp_path / "missing.jsonl"
    line = _one_error(_cli(["prepare", "--target", str(no_model), "--data", str(counting_jsonl), "--data",
                            str(missing), "--out", str(tmp_path / "P")]))
    assert f"data '{missing}' not found" in line, line
