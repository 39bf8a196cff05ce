"""What the commands say to a newcomer: the version, and a flag and an override that set the same key."""

from __future__ import annotations

import importlib.metadata as md
import subprocess
import sys

import yaml

from _harness import ENV, write_config

import dflash_train
from dflash_train.cli import main
from dflash_train.train.admission import admit_start


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
