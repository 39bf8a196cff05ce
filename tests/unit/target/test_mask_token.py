"""`drafter.mask_token_id: null` on any target: the default the tokenizer and the embedding offer, and, where there
is none, one line that names the key and what to set. The shipped GPU config pins no model's id."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import make_tiny_target
from dflash_train.architectures import architecture
from dflash_train.config.load import load_config
from dflash_train.errors import ConfigError
from dflash_train.target.capture import default_mask_token_id, load_tokenizer
from dflash_train.train.start.rank_checks import plan_run

CONFIGS = Path(__file__).resolve().parents[3] / "configs"
CPU = ["run.device=cpu", "drafter.attention_backend=sdpa", "run.dtype=float32", "target.dtype=float32", "target.compile=false", "drafter.compile=false"]


@pytest.fixture(scope="module")
def tok(tokenizer_dir):
    return load_tokenizer(tokenizer_dir)


def test_the_first_embedding_row_past_the_tokenizer_is_the_default(tok):
    last = max(tok.get_vocab().values())
    assert default_mask_token_id(tok, embedding_rows=last + 9) == last + 1
    assert default_mask_token_id(tok, suggestion=16, embedding_rows=last + 9) == 16  # the folder's own choice first


def test_a_reserved_token_is_the_default_where_no_row_is_spare(tokenizer_dir):
    tok = load_tokenizer(tokenizer_dir)
    tok.add_special_tokens({"additional_special_tokens": ["<|reserved_special_token_0|>"]})
    reserved = tok.convert_tokens_to_ids("<|reserved_special_token_0|>")
    assert default_mask_token_id(tok, embedding_rows=reserved + 1) == reserved


def test_without_a_default_the_error_names_the_key_and_the_candidates(tok):
    last = max(tok.get_vocab().values())
    with pytest.raises(ConfigError) as e:
        default_mask_token_id(tok, embedding_rows=last + 1)
    said = str(e.value)
    assert "set drafter.mask_token_id=ID" in said and "<empty_output> (16)" in said, said
    assert f"({tok.eos_token_id})" not in said and f"({tok.pad_token_id})" not in said, said


def test_the_shipped_gpu_config_trains_a_non_qwen_target_as_the_readme_says(tmp_path, tokenizer_dir):
    """README step 2: `configs/qwen3-8b.yaml target.path=/models/my-model`; a target whose embedding has spare
    rows gets the first of them, one without any default is told what to set."""
    spare = make_tiny_target(tmp_path / "spare", tokenizer_dir, vocab_size=49160)
    (spare / "dflash_target.json").unlink()  # no documented choice: the rule alone
    cfg = load_config(CONFIGS / "qwen3-8b.yaml", [f"target.path={spare}", *CPU])
    plan, tok = plan_run(cfg, architecture(cfg.drafter.architecture))
    assert plan.mask_token_id == max(tok.get_vocab().values()) + 1 < 49160
    full = make_tiny_target(tmp_path / "full", tokenizer_dir, vocab_size=len(tok))
    (full / "dflash_target.json").unlink()
    with pytest.raises(ConfigError, match=r"set drafter.mask_token_id=ID \(an override, or in the config\)"):
        plan_run(load_config(CONFIGS / "qwen3-8b.yaml", [f"target.path={full}", *CPU]), architecture("dflash"))


def test_an_id_outside_the_vocabulary_says_what_to_set(tmp_path, tiny_target_dir):
    cfg = load_config(CONFIGS / "qwen3-8b.yaml", [f"target.path={tiny_target_dir}", "drafter.mask_token_id=151669",
                                                  *CPU])
    with pytest.raises(ConfigError, match=r"'drafter.mask_token_id': 151669 is outside .*set it to null for the "
                                          r"target's default"):
        plan_run(cfg, architecture(cfg.drafter.architecture))
