"""The configuration reference (docs/guide/config-reference.md), generated from the config schema itself: every
key's type, default, valid range and the comment written above its field in config/schema.py, then the sections of the
registered architectures (each one's `options.py`), the same way.

    python -m dflash_train.commands.config_reference > docs/guide/config-reference.md

A test regenerates the page and fails when it is stale or when a key has no comment.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
import typing
from typing import Any, Literal, get_args, get_origin

from ..architectures import registry
from ..config.schema import config_sections
from ..config.validate import number_rules

PAGE = "docs/guide/config-reference.md"
_INTRO = """# Configuration reference

Every key of a training config, by section: its type, default, valid values and what it does. A config is YAML
(`configs/` holds the shipped ones); any key can be overridden on the command line as `section.key=value`, e.g.
`optim.lr=3e-4 data.train_files=[a.jsonl,b.jsonl]`. An unknown key, a wrong type or a value out of range is
refused before anything loads, naming the key.

This page is generated from the schema (`src/dflash_train/config/schema.py`, and each architecture's `options.py` for
the sections named after an architecture): run
`python -m dflash_train.commands.config_reference > docs/guide/config-reference.md` after changing a key.
"""


def field_comments(cls: type) -> dict[str, str]:
    """The `#` comment block written directly above each field of the dataclass `cls`, joined into one paragraph."""
    lines, start = inspect.getsourcelines(cls)
    tree = ast.parse(textwrap.dedent("".join(lines)))
    body = tree.body[0].body  # the class definition's statements
    docs: dict[str, str] = {}
    for node in body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        above: list[str] = []
        row = node.lineno - 2  # the line above its declaration, 0-based into `lines`
        while row >= 0 and lines[row].strip().startswith("#"):
            above.insert(0, lines[row].strip().lstrip("#").strip())
            row -= 1
        docs[node.target.id] = " ".join(above)
    return docs


def _type_text(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return " \\| ".join(f"`{v}`" for v in get_args(tp))
    if origin is typing.Union:
        args = [a for a in get_args(tp) if a is not type(None)]
        return " or ".join(_type_text(a) for a in args) + " or null"
    if origin in (list, tuple):
        inner = ", ".join(_type_text(a) for a in get_args(tp) if a is not Ellipsis)
        return f"{origin.__name__} of {inner}" if origin is list else f"({inner})"
    return getattr(tp, "__name__", str(tp))


def _default_text(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return "required"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, tuple):
        value = list(value)
    return str(value)


def sections() -> list[tuple[str, type]]:
    """The generic sections, then the registered architectures' (config.config_sections)."""
    return config_sections()


def undocumented() -> list[str]:
    """Keys whose field has no comment above it (the reference would say nothing about them)."""
    missing = []
    for name, cls in sections():
        docs = field_comments(cls)
        missing += [f"{name}.{f.name}" for f in dataclasses.fields(cls) if not docs.get(f.name)]
    return missing


def reference_markdown() -> str:
    out = [_INTRO]
    rules = number_rules()
    for name, cls in sections():
        docs, hints = field_comments(cls), typing.get_type_hints(cls)
        out.append(f"## {name}\n")
        own = registry.options(name) if registry.entry(name) else registry.NO_OPTIONS
        about, old_names = own.about, {new: old for old, new in own.aliases.items()}
        if about:
            out.append(f"The keys of drafter.architecture={name} ({about}), accepted only when drafter.architecture "
                       f"names it.\n")
        for f in dataclasses.fields(cls):
            key = f"{name}.{f.name}"
            facts = [_type_text(hints[f.name]), f"default `{_default_text(f)}`"]
            if key in rules:
                facts.append(rules[key].describe())
            if f.name in old_names:
                facts.append(f"formerly `{old_names[f.name]}` (still read, with a warning)")
            out.append(f"### `{key}`\n\n{'; '.join(facts)}.\n\n{docs.get(f.name, '')}\n")
    return "\n".join(out).rstrip() + "\n"


if __name__ == "__main__":
    print(reference_markdown(), end="")
