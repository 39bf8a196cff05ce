"""The drafter architectures, by the `drafter.architecture` key. Adding one: a package beside `dflash/` that
defines an `ARCHITECTURE` (see `contract.Architecture`) and, for config keys of its own, a torch-free `options.py`;
then a line in `registry._BUILTIN`, or `registry.register(...)` at run time (docs/architectures/adding.md)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Optional

from . import registry

if TYPE_CHECKING:
    from ..config.schema import Config
    from .contract import Architecture


class UnknownArchitecture(ValueError):
    """A `drafter.architecture` or an exported `architectures` that no registered package provides."""


def architecture(name: str) -> "Architecture":
    """The registered architecture `name` (imported on first use: this module stays light for the CLI)."""
    entry = registry.entry(name)
    if entry is None:
        raise UnknownArchitecture(f"unknown drafter architecture {name!r}; known: {', '.join(registry.names())}")
    package = importlib.import_module(entry.package) if isinstance(entry.package, str) else entry.package
    return getattr(package, "ARCHITECTURE", package)


def reads_target_final(cfg: "Config", arch: Optional["Architecture"] = None) -> bool:
    """Whether the run's objective reads the target's final normed hidden states (`capture(..., with_final=True)`):
    distillation, the on-policy stage (its verification), or an architecture that needs them
    (`Architecture.needs_target_final`). Its captures then run
    every decoder layer, not only those up to the last captured one. `arch`: the run's resolved architecture
    (training passes the one its start resolved; without it, `drafter.architecture`'s)."""
    arch = arch if arch is not None else architecture(cfg.drafter.architecture)
    return cfg.objective.distill_weight > 0 or bool(cfg.onpolicy.start_from) or arch.needs_target_final


def architecture_of_export(config: dict) -> "Architecture":
    """The architecture of an exported drafter, from its config.json (`registry.entry_of_export`: its
    `architectures` and the registered export marks); `registry.NotAnExport`, a ValueError, if none."""
    return architecture(registry.entry_of_export(config).name)
