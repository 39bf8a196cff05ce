"""The drafter architectures, by the `drafter.architecture` key. Adding one: a package beside `dflash/`
that defines an `ARCHITECTURE` (see `base.Architecture`), and a line in `_PACKAGES`."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .base import Architecture

_PACKAGES = {  # drafter.architecture -> (package, the `architectures` name of its exported config.json)
    "dflash": ("dflash", "DFlashDraftModel"),
    "dflash2": ("dflash2", "DFlash2DraftModel"),
}
NAMES = tuple(_PACKAGES)


class UnknownArchitecture(ValueError):
    """A `drafter.architecture` or an exported `architectures` that no registered package provides."""


def architecture(name: str) -> "Architecture":
    """The registered architecture `name` (imported on first use: this module stays light for the CLI)."""
    if name not in _PACKAGES:
        raise UnknownArchitecture(f"unknown drafter architecture {name!r}; known: {', '.join(NAMES)}")
    return importlib.import_module(f"{__name__}.{_PACKAGES[name][0]}").ARCHITECTURE


def architecture_of_export(config: dict) -> "Architecture":
    """The architecture of an exported drafter, from its config.json's `architectures`."""
    names = config.get("architectures")
    for name, (_, hf_name) in _PACKAGES.items():
        if names == [hf_name]:
            return architecture(name)
    known = ", ".join(hf for _, hf in _PACKAGES.values())
    raise UnknownArchitecture(f"not a DFlash drafter config: architectures is {names!r} (this version reads {known})")
