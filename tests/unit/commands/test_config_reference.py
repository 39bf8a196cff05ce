"""The configuration reference page is generated from the schema: every key documented, the page current."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from dflash_train.commands.config_reference import PAGE, field_comments, reference_markdown, undocumented

REPO = Path(__file__).resolve().parents[3]


def test_every_config_key_has_a_comment_in_the_schema():
    assert undocumented() == [], "document these keys with a comment above their field in config/schema.py"


def test_the_reference_page_is_the_generated_one():
    page = (REPO / PAGE).read_text()
    assert page == reference_markdown(), (
        f"{PAGE} is stale: run `python -m dflash_train.commands.config_reference > {PAGE}`")


def test_the_generator_reads_the_comment_block_above_each_field_and_only_that():
    @dataclasses.dataclass
    class Example:
        # Two lines
        # of doc.
        a: int = 1
        b: str = "x"

        # After a blank line.
        c: float = 0.5

    docs = field_comments(Example)
    assert docs == {"a": "Two lines of doc.", "b": "", "c": "After a blank line."}


def test_the_page_names_every_key_with_its_default_and_range():
    page = reference_markdown()
    assert "### `optim.max_steps`\n\nint; default `0`; an integer >= 0 (0 = all optim.epochs)." in page
    assert "### `drafter.attention_backend`\n\n`auto` \\| `flex` \\| `sdpa`; default `auto`." in page
