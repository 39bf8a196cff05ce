"""One owner for each fact a training run reads everywhere: the architecture is resolved once per rank (at its
admission) and passed on as an object, the attention backend is resolved once (at the rank's set-up), and generic
train and data code reads the block size from the drafter's config, never `drafter.block_size` of the run's config."""

import dataclasses
import re
import sys
from pathlib import Path

import pytest
import yaml

from dflash_train.architectures import architecture, registry
from dflash_train.cli import main

TRAIN = Path(__file__).resolve().parents[4] / "src" / "dflash_train"


def _train_module(frame) -> str:
    """The module that asked: the first frame, going outwards, outside the architectures package and this file;
    "files" for a drafter's files, which name their architecture (`architectures.io` reads it off them)."""
    while frame is not None and (frame.f_globals.get("__name__", "").startswith("dflash_train.architectures")
                                 or frame.f_code.co_filename == __file__):
        if frame.f_globals.get("__name__") == "dflash_train.architectures.io":
            return "files"
        frame = frame.f_back
    return frame.f_globals.get("__name__", "") if frame is not None else ""


class CountingPackage:
    """Where the registry finds DFlash: the real architecture, counting who resolves it and its attention backend."""

    def __init__(self):
        self.real = architecture("dflash")
        self.resolutions: list[str] = []
        self.backends: list[str] = []

    @property
    def ARCHITECTURE(self):
        self.resolutions.append(_train_module(sys._getframe(1)))
        return dataclasses.replace(self.real, resolve_backend=self.resolve_backend)

    def resolve_backend(self, *args, **kwargs):
        self.backends.append(_train_module(sys._getframe(1)))
        return self.real.resolve_backend(*args, **kwargs)


@pytest.mark.long  # ~11 s: a whole run and its resume
def test_a_run_resolves_its_architecture_and_attention_backend_once(tmp_path, tiny_target_dir, counting_jsonl,
                                                                    monkeypatch):
    counting = CountingPackage()
    monkeypatch.setitem(registry._REGISTRY, "dflash",
                        dataclasses.replace(registry._REGISTRY["dflash"], package=counting))
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump({
        "target": {"path": str(tiny_target_dir)},
        "drafter": {"architecture": "dflash", "num_draft_layers": 1, "block_size": 4, "attention_backend": "sdpa"},
        "data": {"train_files": [str(counting_jsonl)], "max_length": 256, "token_budget": 1024, "max_batch_size": 4},
        "run": {"device": "cpu", "log_every": 1, "save_every": 2, "progress_bar": False}}))
    assert main(["train", str(config), "--run-dir", str(tmp_path / "R"), "--max-steps", "3"]) == 0
    by_training = [m for m in counting.resolutions if m.startswith("dflash_train.train")]
    assert by_training == ["dflash_train.train.start.rank_checks"]
    by_training = [m for m in counting.backends if m.startswith("dflash_train.train")]
    assert by_training == ["dflash_train.train.start.rank_setup"]


def test_generic_training_and_data_code_reads_the_block_size_from_the_drafters_config():
    key = re.compile(r"\bcfg\.drafter\.block_size\b")
    found = [f"{path.relative_to(TRAIN.parent)}:{n}: {line.strip()}"
             for folder in ("train", "data") for path in sorted((TRAIN / folder).rglob("*.py"))
             for n, line in enumerate(path.read_text().splitlines(), 1) if key.search(line)]
    assert not found, ("read the drafter config's block size (Admitted.block_size, drafter.block_size):\n"
                       + "\n".join(found))
