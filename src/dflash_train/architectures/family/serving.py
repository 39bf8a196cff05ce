"""What the block-drafter family's members share in how the engines serve their exports (torch-free: the members'
`options.py` import it): the reference DFlash serving arguments and the full-vocabulary restriction."""

from __future__ import annotations

from typing import Any, Mapping

from ..registry import Note


def reduced_vocabulary(config_json: Mapping[str, Any]) -> bool:
    """An export that scores a reduced draft vocabulary with its own lm_head (top-level `draft_vocab_size`)."""
    return bool(config_json.get("draft_vocab_size"))


FULL_VOCABULARY = Note("full vocabulary only", reduced_vocabulary, refuses=True)
VLLM_ARGUMENTS = """--speculative-config '{"method": "dflash", "model": "{dir}", "num_speculative_tokens": {count}}'"""
SGLANG_ARGUMENTS = ("--speculative-algorithm DFLASH --speculative-draft-model-path {dir} "
                    "--speculative-num-draft-tokens {count}")
