"""The drafter architectures by name, without importing any of them: the values `drafter.architecture` takes
(config/validate.py checks them), the `architectures` name of each one's exported config.json, and where each one's
code and torch-free options live. `algorithms.architecture(name)` resolves a name to its `Architecture`; config/ reads
each one's config section through `options(name)`.

An architecture is registered by a line in `_BUILTIN` (the packages under `algorithms/`), or at run time with
`register(...)`, which also takes objects instead of module names (an architecture defined in a test file: see
docs/architectures/adding.md). Nothing here imports torch: `dflash-train status` and the config loader stay light.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Union

from .numbers import Rule


@dataclass(frozen=True)
class Options:
    """What an architecture declares without torch (its package's `options.py` defines `OPTIONS = Options(...)`).

    - `section`: the dataclass of its own config keys (the YAML section named after the architecture,
      `NAME: {key: value}`, override `NAME.key=value`); each field with a `#` comment above it, which the
      configuration reference prints. None: no keys of its own.
    - `number_rules`: the range of each numeric key of the section, by its name in the section.
    - `validate(cfg)`: its cross-checks against the whole config (raise `ConfigError("config key 'NAME.key': ...")`).
    - `aliases`: old flat keys ("drafter.KEY") -> the key in the section they now are; read with one
      deprecation warning, so older config files and runs' config.yaml still load.
    - `about`: what the section configures, for the message that refuses it under another drafter.architecture.
    - `training_layout(config_json)`: whether an exported-format folder's weights are a training-time layout the
      export turns into the reference one (a checkpoint's config.json, read without loading anything).
    """

    section: Optional[type] = None
    number_rules: Mapping[str, Rule] = field(default_factory=dict)
    validate: Optional[Callable[[Any], None]] = None
    aliases: Mapping[str, str] = field(default_factory=dict)
    about: str = ""
    training_layout: Optional[Callable[[dict], bool]] = None


NO_OPTIONS = Options()


@dataclass(frozen=True)
class Registered:
    name: str  # the `drafter.architecture` value
    hf_architecture: str  # `architectures[0]` of its exported config.json
    # A module name whose `ARCHITECTURE` is its `algorithms.base.Architecture` (imported on first use), or that
    # object itself (or any object with an `ARCHITECTURE`).
    package: Any
    # A module name whose `OPTIONS` is its `Options` (imported with importlib when a config loads: it must not import
    # torch, nor make its package's __init__ import it), an `Options` object, or None (no options).
    options: Union[str, Options, None] = None


# The architectures this package ships: drafter.architecture -> where it lives. The order is the order of the
# configuration reference's sections and of the messages that list them.
_BUILTIN = (
    Registered("dflash", "DFlashDraftModel", "dflash_train.algorithms.dflash"),
    Registered("dflash2", "DFlash2DraftModel", "dflash_train.algorithms.dflash2", "dflash_train.algorithms.dflash2.options"),
    Registered("dspark", "Qwen3DSparkModel", "dflash_train.algorithms.dspark", "dflash_train.algorithms.dspark.options"),
    Registered("domino", "DominoDraftModel", "dflash_train.algorithms.domino", "dflash_train.algorithms.domino.options"),
)
_REGISTRY: dict[str, Registered] = {r.name: r for r in _BUILTIN}
DEFAULT = "dflash"


def register(name: str, hf_architecture: str, package: Any, options: Union[str, Options, None] = None) -> Registered:
    """Add an architecture (see `Registered` for what `package` and `options` may be): `drafter.architecture=NAME`
    then trains it, and an export whose `architectures` is `[hf_architecture]` loads with it. A name or HF name
    already registered is refused (`unregister` it first)."""
    if not name.isidentifier() or name in _REGISTRY:
        raise ValueError(f"architecture name {name!r} is taken or not an identifier (registered: {', '.join(names())})")
    if any(r.hf_architecture == hf_architecture for r in _REGISTRY.values()):
        raise ValueError(f"the exported architectures name {hf_architecture!r} is already registered")
    entry = _REGISTRY[name] = Registered(name, hf_architecture, package, options)
    return entry


def unregister(name: str) -> None:
    """Remove an architecture added by `register` (the built-in ones stay)."""
    if any(r.name == name for r in _BUILTIN):
        raise ValueError(f"{name!r} is built in")
    _REGISTRY.pop(name, None)


def names() -> tuple[str, ...]:
    """The registered `drafter.architecture` values."""
    return tuple(_REGISTRY)


def entry(name: str) -> Optional[Registered]:
    return _REGISTRY.get(name)


def entries() -> tuple[Registered, ...]:
    return tuple(_REGISTRY.values())


def options(name: str) -> Options:
    """The `Options` of a registered architecture (NO_OPTIONS for one without, or an unknown name)."""
    r = _REGISTRY.get(name)
    if r is None or r.options is None:
        return NO_OPTIONS
    if isinstance(r.options, str):
        # importlib, not an import statement: the options module sits in its architecture's package (layer 2, above
        # config); what it holds is torch-free and config reads it only when a config loads.
        return importlib.import_module(r.options).OPTIONS
    return r.options
