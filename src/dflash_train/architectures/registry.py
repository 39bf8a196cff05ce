"""The drafter architectures by name, without importing any of them: the values `drafter.architecture` takes
(config/validate.py checks them), the `architectures` name of each one's exported config.json, and where each one's
code and torch-free options live. `architectures.architecture(name)` resolves a name to its `Architecture`; config/ reads
each one's config section through `options(name)`.

An architecture is registered by a line in `_BUILTIN` (the packages under `architectures/`), or at run time with
`register(...)`, which also takes objects instead of module names (an architecture defined in a test file: see
docs/architectures/adding.md). Nothing here imports torch: `dflash-train status` and the config loader stay light.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Union

from ..numbers import Rule


@dataclass(frozen=True)
class Note:
    """A fact about how one engine serves an architecture's exports."""

    text: str  # as the serve tables print it, e.g. "full vocabulary only"
    # Whether it concerns one export, from its config.json; None: every export. A model card prints only those that do.
    holds: Optional[Callable[[Mapping[str, Any]], bool]] = None
    # Where it holds, the engine does not serve the export (the card says so instead of giving a command).
    refuses: bool = False


@dataclass(frozen=True)
class Engine:
    """How one serving engine serves an architecture's exports."""

    name: str  # "vLLM", "SGLang"
    # Its arguments for the exported folder `{dir}`, `{count}` being the value of `count_key`; empty: not served.
    arguments: str = ""
    count_key: str = ""  # the setting that takes the token count, e.g. `num_speculative_tokens`
    # The count holds the verified anchor too (one more than the drafts), as SGLang's --speculative-num-draft-tokens.
    count_with_anchor: bool = False
    notes: tuple[Note, ...] = ()
    unsupported: str = ""  # where `arguments` is empty: what stands instead, e.g. "not supported upstream"


@dataclass(frozen=True)
class Serving:
    """How an architecture's exports are served: `serving.py` renders the README's and the guide's serve tables and
    every model card's serve lines from it."""

    title: str  # how cards and tables name the architecture, e.g. "DFlash"
    # Whether the anchor's slot predicts too: a block of B slots drafts B tokens, else B - 1 (`Drafter.num_drafts`).
    anchor_drafts: bool
    engines: tuple[Engine, ...]
    reference: str = ""  # the reference code that loads its exports, for the card, e.g. "z-lab/dflash"


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
    - `defaults`: generic keys ("section.key") whose default differs under this architecture (the loader sets them
      when the config does not give them; `validate` then sees only values a user chose or these).
    - `draft_vocabulary`: whether it implements a reduced draft vocabulary (`drafter.draft_vocab_size > 0`: its own
      trained lm_head over the most frequent label tokens); config validation refuses the key elsewhere.
    - `confidence_head(config_json)`: whether an export predicts each draft's acceptance (`Drafter.has_confidence`,
      which `eval --confidence-threshold` needs), from its config.json alone. None: no export of it does.
    - `tree_refusal(config_json)`: why an export cannot be decoded with DDTree (`eval --tree-budget`; the message
      `Drafter.check_tree_decoding` raises), from its config.json alone; None where it can. Left unset: every export
      can.
    - `serving`: how its exports are served (`Serving`), the one source of the serve tables and the model cards'
      serve lines. None: the cards give no serve lines.
    """

    section: Optional[type] = None
    number_rules: Mapping[str, Rule] = field(default_factory=dict)
    validate: Optional[Callable[[Any], None]] = None
    aliases: Mapping[str, str] = field(default_factory=dict)
    about: str = ""
    training_layout: Optional[Callable[[dict], bool]] = None
    defaults: Mapping[str, Any] = field(default_factory=dict)
    draft_vocabulary: bool = False
    # Whether the on-policy stage (`onpolicy.start_from`, `family/onpolicy.py`) trains it: its `Architecture` then
    # names the stage's objective (`onpolicy_objective`), which knows the drafter's decoding distribution.
    on_policy: bool = False
    confidence_head: Optional[Callable[[dict], bool]] = None
    tree_refusal: Optional[Callable[[dict], Optional[str]]] = None
    serving: Optional[Serving] = None


NO_OPTIONS = Options()


@dataclass(frozen=True)
class Registered:
    name: str  # the `drafter.architecture` value
    hf_architecture: str  # `architectures[0]` of its exported config.json
    # A module name whose `ARCHITECTURE` is its `architectures.contract.Architecture` (imported on first use), or that
    # object itself (or any object with an `ARCHITECTURE`).
    package: Any
    # A module name whose `OPTIONS` is its `Options` (imported with importlib when a config loads: it must not import
    # torch, nor make its package's __init__ import it), an `Options` object, or None (no options).
    options: Union[str, Options, None] = None
    # What tells its exports apart from another architecture's with the same `hf_architecture`: dotted config.json
    # keys and the values they hold in its exports (e.g. {"dflash_config.projector_type": "NAME"}). See
    # `entry_of_export`.
    export_marks: Mapping[str, Any] = field(default_factory=dict)


# The architectures this package ships: drafter.architecture -> where it lives. The order is the order of the
# configuration reference's sections and of the messages that list them.
_BUILTIN = (
    Registered("dflash", "DFlashDraftModel", "dflash_train.architectures.dflash", "dflash_train.architectures.dflash.options"),
    Registered("dflash2", "DFlash2DraftModel", "dflash_train.architectures.dflash2", "dflash_train.architectures.dflash2.options"),
    Registered("dspark", "Qwen3DSparkModel", "dflash_train.architectures.dspark", "dflash_train.architectures.dspark.options"),
    Registered("domino", "DFlashDraftModel", "dflash_train.architectures.domino", "dflash_train.architectures.domino.options", {"dflash_config.projector_type": "domino"}),
    Registered("lilicorr", "LiLiCorrDraftModel", "dflash_train.architectures.lilicorr", "dflash_train.architectures.lilicorr.options"),
)
_REGISTRY: dict[str, Registered] = {r.name: r for r in _BUILTIN}
DEFAULT = "dflash"


def register(name: str, hf_architecture: str, package: Any, options: Union[str, Options, None] = None,
             export_marks: Optional[Mapping[str, Any]] = None) -> Registered:
    """Add an architecture (see `Registered` for what `package`, `options` and `export_marks` may be):
    `drafter.architecture=NAME` then trains it, and an export whose `architectures` is `[hf_architecture]` (and
    whose keys hold `export_marks`) loads with it. A name already registered, or an HF name registered with the
    same marks, is refused (`unregister` it first)."""
    if not name.isidentifier() or name in _REGISTRY:
        raise ValueError(f"architecture name {name!r} is taken or not an identifier (registered: {', '.join(names())})")
    marks = dict(export_marks or {})
    if any(r.hf_architecture == hf_architecture and dict(r.export_marks) == marks for r in _REGISTRY.values()):
        raise ValueError(f"the exported architectures name {hf_architecture!r} is already registered"
                         + (f" with the marks {marks}" if marks else "") + ": give export_marks that tell them apart")
    entry = _REGISTRY[name] = Registered(name, hf_architecture, package, options, marks)
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


class NotAnExport(ValueError):
    """A config.json that no registered architecture exports."""


_ABSENT = object()


def _value_at(config: Mapping, dotted: str) -> Any:
    node: Any = config
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return _ABSENT
        node = node[part]
    return node


def entry_of_export(config_json: Mapping) -> Registered:
    """The architecture whose export `config_json` (a parsed config.json) is: among those whose `hf_architecture`
    is its `architectures`, the one whose `export_marks` all hold, the one with most marks first. A config.json
    that holds a key some of them mark, with a value none of them claims, is refused rather than read as the
    unmarked one (a projector of a kind this version does not know)."""
    names_ = config_json.get("architectures") if isinstance(config_json, Mapping) else None
    same = [r for r in _REGISTRY.values() if names_ == [r.hf_architecture]]
    if not same:
        known = ", ".join(sorted({r.hf_architecture for r in _REGISTRY.values()}))
        raise NotAnExport(f"not a DFlash drafter config: architectures is {names_!r} (this version reads "
                          f"{known})")
    fits = [r for r in same if all(_value_at(config_json, k) == v for k, v in r.export_marks.items())]
    best = max(fits, key=lambda r: len(r.export_marks), default=None)
    marked = sorted({k for r in same for k in r.export_marks})
    stray = [k for k in marked if _value_at(config_json, k) is not _ABSENT and (best is None or k not in best.export_marks)]
    if best is None or stray:
        key = (stray or marked)[0]
        value = _value_at(config_json, key)
        claims = ", ".join([f"{r.export_marks[key]!r} ({r.name})" for r in same if key in r.export_marks]
                           + [f"absent ({r.name})" for r in same if key not in r.export_marks])
        raise NotAnExport(f"{names_[0]} config with {key} "
                          f"{'absent' if value is _ABSENT else repr(value)}: this version reads {claims}")
    return best


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
