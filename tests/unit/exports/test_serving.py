"""The serve advice has one source, each architecture's `serving` declaration: README.md and the eval-and-export guide
hold exactly the table rendered from it, `python -m dflash_train.exports.serving` rewrites it, and rendering it imports no
torch (the declarations sit in the torch-free options modules)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from dflash_train.exports import serving
from dflash_train.architectures import registry

REPO = Path(__file__).resolve().parents[3]


def test_the_readme_and_the_guide_hold_the_generated_serve_table():
    table = serving.serve_table()
    for page in serving.PAGES:
        text = (REPO / page).read_text()
        assert serving.rewritten(text, page) == text, (
            f"{page}'s serve table is stale: run `python -m dflash_train.exports.serving` from the repository's root")
        assert table in text


def test_every_builtin_architecture_declares_each_engine_of_the_table():
    engines = {e.name for name in registry.names() for e in serving.serving_of(name).engines}
    for name in registry.names():
        declared = serving.serving_of(name)
        assert declared is not None, name
        assert {e.name for e in declared.engines} == engines, name  # "not supported" is declared, not left out
        assert f"| `{name}`" in serving.serve_table()


def test_the_command_rewrites_only_the_table_and_refuses_a_page_without_its_markers(tmp_path):
    page = tmp_path / "page.md"
    before, after = "# Title\n\nText before.\n\n", "\n\nText after, kept.\n"
    page.write_text(before + serving.BEGIN + "\n\n| an old | table |\n" + serving.END + after)
    done = subprocess.run([sys.executable, "-m", "dflash_train.exports.serving", str(page)], capture_output=True, text=True,
                          cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert page.read_text() == before + serving.BEGIN + "\n\n" + serving.serve_table() + "\n" + serving.END + after
    again = subprocess.run([sys.executable, "-m", "dflash_train.exports.serving", str(page)], capture_output=True, text=True)
    assert again.returncode == 0 and again.stdout == ""  # current: nothing rewritten
    bare = tmp_path / "bare.md"
    bare.write_text("# No table here\n")
    refused = subprocess.run([sys.executable, "-m", "dflash_train.exports.serving", str(bare)], capture_output=True,
                             text=True)
    assert refused.returncode == 2 and bare.read_text() == "# No table here\n"
    assert refused.stderr.count("\n") == 1 and str(bare) in refused.stderr and "markers" in refused.stderr


def test_the_serve_table_renders_without_torch():
    code = ("import sys\nfrom dflash_train.exports import serving\nserving.serve_table()\n"
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
