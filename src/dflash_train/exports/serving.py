"""How an exported drafter is served, rendered from what each architecture declares (`registry.Serving`, in its
torch-free `options.py`): the serve table of README.md and of docs/guide/eval-and-export.md, and the serve lines of
every model card (`card.py`), with the numbers of that drafter's block size and the notes its config.json
meets.

    python -m dflash_train.exports.serving

rewrites the table between the markers in both pages (run it from the repository's root); a test fails when a page
holds another table than this module renders.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from ..architectures import registry
from ..architectures.registry import Engine, Serving
from ..errors import EXIT_USER_ERROR, UserError

PAGES = ("README.md", "docs/guide/eval-and-export.md")
BEGIN = "<!-- serve table: written by `python -m dflash_train.exports.serving` from each architecture's `serving` -->"
END = "<!-- end of the serve table -->"
DIR = "DIR"


def serving_of(name: str) -> Optional[Serving]:
    """What the architecture `name` declares (None: nothing)."""
    return registry.options(name).serving


def drafts(serving: Serving, block_size: int) -> int:
    """Tokens one block drafts: every slot where the anchor's slot predicts too, else all but the anchor's."""
    return block_size if serving.anchor_drafts else block_size - 1


def count(serving: Serving, engine: Engine, block_size: int) -> int:
    """The value of the engine's `count_key` for a drafter of `block_size`."""
    return drafts(serving, block_size) + (1 if engine.count_with_anchor else 0)


def count_rule(serving: Serving, engine: Engine) -> str:
    """`num_speculative_tokens = block_size - 1`: the count in terms of the block size."""
    offset = count(serving, engine, 0)
    return f"{engine.count_key} = block_size" + (f" {'+' if offset > 0 else '-'} {abs(offset)}" if offset else "")


def command(serving: Serving, engine: Engine, block_size: int, folder: str = DIR) -> str:
    return engine.arguments.replace("{dir}", folder).replace("{count}", str(count(serving, engine, block_size)))


def table_cell(serving: Serving, engine: Optional[Engine], block_size: int) -> str:
    if engine is None or not engine.arguments:
        return (engine.unsupported if engine else "") or "not supported"
    return "; ".join([f"`{command(serving, engine, block_size)}` (`{count_rule(serving, engine)}`)"]
                     + [note.text for note in engine.notes])


def example_block_size(name: str) -> int:
    """The block size a config that names only `drafter.architecture: name` trains (the tables' example)."""
    from ..config.load import config_from_dict

    return config_from_dict({"drafter": {"architecture": name}}).drafter.block_size


def serve_table() -> str:
    """The Markdown serve table of every registered architecture that declares its serving, one column per engine."""
    declared = [(name, s) for name in registry.names() if (s := serving_of(name)) is not None]
    engines: list[str] = []
    for _, s in declared:
        engines += [e.name for e in s.engines if e.name not in engines]
    sizes = {name: example_block_size(name) for name, _ in declared}
    lines = ["| `drafter.architecture` | " + " | ".join(engines) + " |", "|---" * (len(engines) + 1) + "|"]
    for name, s in declared:
        by_engine = {e.name: e for e in s.engines}
        label = f"`{name}`" + (" (default)" if name == registry.DEFAULT else "")
        lines.append(f"| {label} | " + " | ".join(table_cell(s, by_engine.get(e), sizes[name]) for e in engines)
                     + " |")
    shown = sorted(set(sizes.values()))
    sizes_text = " or ".join(map(str, shown))
    return ("\n".join(lines) + f"\n\n{DIR} is the exported folder. The numbers are for block size {sizes_text}, the "
            "default `drafter.block_size`;\neach model card gives its drafter's own.\n")


def card_section(name: str, block_size: int, config_json: Mapping[str, Any]) -> str:
    """The model card's serve lines for an export of the architecture `name` with this block size and config.json:
    each engine's command, or why it does not serve this export; the notes that concern it. Empty where the
    architecture declares nothing."""
    s = serving_of(name)
    if s is None:
        return ""
    lines = [f"## Serve\n\n{DIR} is this folder; block size {block_size}, {drafts(s, block_size)} drafts per step.\n"]
    for engine in s.engines:
        lines.append(f"- {engine.name}: {_engine_advice(s, engine, block_size, config_json)}")
    return "\n".join(lines) + "\n"


def _engine_advice(s: Serving, engine: Engine, block_size: int, config_json: Mapping[str, Any]) -> str:
    if not engine.arguments:
        return engine.unsupported or "not supported"
    applies = [n for n in engine.notes if n.holds is None or n.holds(config_json)]
    refused = [n.text for n in applies if n.refuses]
    if refused:
        return "not for this export: " + "; ".join(refused)
    return "; ".join([f"`{command(s, engine, block_size)}`"] + [n.text for n in applies])


def rewritten(text: str, where: str) -> str:
    """`text` with the serve table between the markers replaced by the current one."""
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise UserError(f"{where}: the serve table's markers are missing (a line {BEGIN!r}, then {END!r}); put them "
                        "where the table goes")
    return text[:start] + BEGIN + "\n\n" + serve_table() + "\n" + text[end:]


def main(argv: Sequence[str] = ()) -> int:
    pages = [Path(p) for p in (argv or PAGES)]
    try:
        for page in pages:
            if not page.is_file():
                raise UserError(f"{page} is not there: run `python -m dflash_train.exports.serving` from the repository's root")
            text = page.read_text()
            new = rewritten(text, str(page))
            if new != text:
                page.write_text(new)
                print(f"rewrote the serve table of {page}")
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USER_ERROR
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
