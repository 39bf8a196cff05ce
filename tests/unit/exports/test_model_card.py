"""The model cards of real exports: each architecture's card is titled with its name and carries the serve lines its
`serving` declaration renders for its block size and config.json; `dflash-train export` writes the same card the
run's own export has; the card and dflash_train.json name the target as the run did (`smollm2`, not this machine's
converted folder)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from dflash_train.exports import serving
from dflash_train.architectures.io import load_drafter
from dflash_train.cli import main

# Each architecture's own keys, small; DSpark's head without the confidence head and with a gated Markov head: two
# notes of its serving hold for that export.
OWN = {
    "dflash": {},
    "dflash2": {"dflash2": {"selector_rank": 8, "selector_top_k": 4}},
    "dspark": {"dspark": {"markov_rank": 8, "markov_head_type": "gated", "confidence_head": False,
                          "confidence_weight": 0.0}},
    "domino": {"domino": {"gru_hidden_dim": 16, "emb_dim": 8}},
}

# What the cards of these exports (block size 4, float32) say per engine: the declared notes that concern them.
SERVED = {
    "dflash": {"vLLM": ['"method": "dflash"', '"num_speculative_tokens": 3}'],
               "SGLang": ["--speculative-algorithm DFLASH", "--speculative-num-draft-tokens 4`"]},
    "dflash2": {"vLLM": ['"num_speculative_tokens": 3}', "V2 model runner only"],
                "SGLang": ["--speculative-num-draft-tokens 4`"]},
    "dspark": {"vLLM": ["not for this export: vanilla Markov heads only"],
               "SGLang": ["--speculative-algorithm DSPARK", "--speculative-num-draft-tokens 5`",
                          "`SGLANG_RAGGED_VERIFY_MODE=static`"]},
    "domino": {"vLLM": ["not supported upstream"], "SGLang": ["not for this export: BF16 weights"]},
}


def _train_one_step(tmp_path: Path, target: str, data: Path, architecture: str = "dflash", **own) -> Path:
    cfg = {"target": {"path": target},
           "drafter": {"architecture": architecture, "num_draft_layers": 1, "block_size": 4,
                       "attention_backend": "sdpa", "intermediate_size": 64},
           "data": {"train_files": [str(data)], "max_length": 128, "token_budget": 256, "max_batch_size": 1},
           "objective": {"max_anchors": 8}, "optim": {"lr": 3e-3, "epochs": 1},
           "run": {"device": "cpu", "log_every": 1, "save_every": 1, "progress_bar": False, "eval_every": 0,
                   "export_dtype": "float32"}, **own}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    run = tmp_path / "run"
    assert main(["train", str(tmp_path / "c.yaml"), "--run-dir", str(run), "--max-steps", "1"]) == 0
    return run


def _cards(tmp_path: Path, run: Path) -> tuple[str, str, Path]:
    """The run's export card and the card `dflash-train export` writes for its last checkpoint (and that folder)."""
    out = tmp_path / "exported"
    assert main(["export", str(run / "checkpoints" / "step-1"), "--out", str(out), "--dtype", "float32"]) == 0
    return (run / "export" / "README.md").read_text(), (out / "README.md").read_text(), out


@pytest.mark.parametrize("architecture", list(OWN))
def test_each_architectures_card_names_it_and_serves_it_as_its_declaration_says(architecture, tmp_path,
                                                                                tiny_target_dir, counting_jsonl):
    run = _train_one_step(tmp_path, str(tiny_target_dir), counting_jsonl, architecture, **OWN[architecture])
    trained, exported, folder = _cards(tmp_path, run)
    declared = serving.serving_of(architecture)
    drafter = load_drafter(folder)
    config_json = json.loads((folder / "config.json").read_text())
    assert trained.splitlines()[0] == exported.splitlines()[0] == f"# {declared.title} drafter"
    assert declared.title.lower() == architecture  # the title is the architecture's own name
    section = serving.card_section(architecture, drafter.block_size, config_json)
    assert f"block size {drafter.block_size}, {drafter.num_drafts()} drafts per step" in section
    assert section in trained and section in exported
    record = json.loads((folder / "dflash_train.json").read_text())
    assert record["num_speculative_tokens"] == serving.drafts(declared, drafter.block_size) == drafter.num_drafts()
    # `dflash-train export` carries what the training card says: every line but which weights and where it came from
    kept = set(exported.splitlines())
    missing = [line for line in trained.splitlines()
               if line not in kept and not line.startswith(("- weights:", "A "))]
    assert not missing, missing
    assert "## Training config" in exported and f"- target: `{tiny_target_dir.resolve()}`" in exported
    served = {line.split(":", 1)[0][2:]: line.split(": ", 1)[1]
              for line in section.splitlines() if line.startswith("- ")}
    for engine, wanted in SERVED[architecture].items():
        assert all(w in served[engine] for w in wanted), (engine, served[engine])


@pytest.mark.slow  # the real SmolLM2 target, the embedded default
def test_the_embedded_target_is_recorded_by_name_and_an_older_record_still_exports(tmp_path, smollm2_dir,
                                                                                  counting_jsonl):
    run = _train_one_step(tmp_path, "smollm2", counting_jsonl)
    assert json.loads((run / "dflash_train.json").read_text())["target"] == "smollm2"
    trained, exported, folder = _cards(tmp_path, run)
    assert "- target: `smollm2`" in trained and "- target: `smollm2`" in exported
    assert str(smollm2_dir) not in trained + exported + (folder / "dflash_train.json").read_text()
    # a record written before names the converted folder: it still exports, and the card says what it records
    record = json.loads((run / "dflash_train.json").read_text())
    (run / "dflash_train.json").write_text(json.dumps({**record, "target": str(smollm2_dir)}))
    again = tmp_path / "again"
    assert main(["export", str(run / "checkpoints" / "step-1"), "--out", str(again), "--dtype", "float32"]) == 0
    assert f"- target: `{smollm2_dir}`" in (again / "README.md").read_text()
