"""The drafter architectures, by the `drafter.architecture` key. Adding one: a package beside `dflash/`
that defines an `ARCHITECTURE` (see `base.Architecture`), and a line in `architectures.PACKAGES` (the names, which
config.py checks without importing this package)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from ..architectures import NAMES, PACKAGES

if TYPE_CHECKING:
    from .base import Architecture


class UnknownArchitecture(ValueError):
    """A `drafter.architecture` or an exported `architectures` that no registered package provides."""


def architecture(name: str) -> "Architecture":
    """The registered architecture `name` (imported on first use: this module stays light for the CLI)."""
    if name not in PACKAGES:
        raise UnknownArchitecture(f"unknown drafter architecture {name!r}; known: {', '.join(NAMES)}")
    return importlib.import_module(f"{__name__}.{PACKAGES[name][0]}").ARCHITECTURE


def architecture_of_export(config: dict) -> "Architecture":
    """The architecture of an exported drafter, from its config.json's `architectures`."""
    names = config.get("architectures")
    for name, (_, hf_name) in PACKAGES.items():
        if names == [hf_name]:
            return architecture(name)
    known = ", ".join(hf for _, hf in PACKAGES.values())
    raise UnknownArchitecture(f"not a DFlash drafter config: architectures is {names!r} (this version reads {known})")
