"""Loading a config: YAML in (a key given twice refused), dotted `key=value` overrides, the old flat keys of an
architecture's section read under their new names, and the config written back out.

`load_config` is the only way a run gets its config. Unknown keys and wrong types raise `ConfigError` naming the
key and listing the valid ones.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import re
import reprlib
import types
import typing
from pathlib import Path
from typing import Any, Literal, Optional, Union, get_args, get_origin

import yaml

from ..errors import ConfigError
from ..files.io import write_text_atomic
from .schema import Config, _section_fields, _sections
from .validate import _check_section_numbers, validate

log = logging.getLogger(__name__)
_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother, _REPR.maxlist, _REPR.maxdict = 3, 80, 80, 8, 8
_INT_LIMIT = 2**63  # ints are counts, ids and seeds: beyond int64 nothing downstream can use them
# YAML 1.1 (PyYAML) reads `1e-4` (no dot) as a string; a float key accepts it as the number it means.
_EXPONENT_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


def _quoted(text: str, limit: int = 120) -> str:
    """A user's own text (an override) in quotes, as typed, cut to `limit` characters."""
    return f"'{text}'" if len(text) <= limit else f"'{text[: limit - 20]}...{text[-10:]}' ({len(text)} characters)"


def _show(value: Any) -> str:
    """A short repr for messages: bounded for huge, deep or self-referencing values."""
    try:
        return _REPR.repr(value)
    except (ValueError, RecursionError):  # e.g. an int beyond Python's 4300-digit str limit
        return f"<{type(value).__name__}>"


# ---------------------------------------------------------------------------- parsing


def _type_name(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in get_args(tp))
    if origin in (Union, types.UnionType):
        return " | ".join(_type_name(a) for a in get_args(tp))
    if origin is not None:
        return f"{origin.__name__}[{', '.join(_type_name(a) for a in get_args(tp))}]"
    return "null" if tp is type(None) else getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check `value` against the annotation `tp`; return it in canonical form or raise."""
    origin = get_origin(tp)
    bad = ConfigError(f"config key '{key}': expected {_type_name(tp)}, got {_show(value)} ({type(value).__name__})")
    if origin is Literal:
        if value not in get_args(tp):
            raise bad
        return value
    if origin in (Union, types.UnionType):
        args = get_args(tp)
        if value is None:
            if type(None) in args:
                return None
            raise bad
        options = [a for a in args if a is not type(None)]
        if len(options) == 1:  # Optional[X]: X's own, more precise error
            return _coerce(value, options[0], key)
        for arg in options:
            try:
                return _coerce(value, arg, key)
            except ConfigError:
                continue
        raise bad
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise bad
        args = get_args(tp)
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(value) != len(args):
                raise bad
            return tuple(_coerce(v, a, f"{key}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
        elem = args[0] if args else Any
        items = [_coerce(v, elem, f"{key}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if tp is bool:
        if not isinstance(value, bool):
            raise bad
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad
        if not -_INT_LIMIT <= value < _INT_LIMIT:
            raise ConfigError(f"config key '{key}': {_show(value)} is out of range (a 64-bit integer is expected)")
        return value
    if tp is float:
        if isinstance(value, str) and _EXPONENT_FLOAT.fullmatch(value.strip()):
            value = float(value)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad
        try:
            value = float(value)
        except OverflowError:  # an int too large for a float
            value = math.inf
        if not math.isfinite(value):
            raise ConfigError(f"config key '{key}': must be a finite number, got {value}")
        return value
    if tp is str:
        if not isinstance(value, str):
            raise bad
        return value
    if tp is Any:
        return value
    raise ConfigError(f"config key '{key}': unsupported type {tp}")


def _build(cls: type, data: Any, prefix: str, also_valid: tuple[str, ...] = ()) -> Any:
    """`cls` from the mapping `data` (`also_valid`: more keys the caller takes out before, listed as valid)."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.metadata.get("section", True)}
    where = prefix.rstrip(".") or "the top level"
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"config section '{where}' must be a mapping, got {type(data).__name__}")
    kwargs = {}
    for name, value in data.items():
        if name not in fields:
            valid = ", ".join(sorted([*fields, *also_valid]))
            raise ConfigError(f"unknown config key '{prefix}{name}'; valid keys in {where}: {valid}")
        tp = hints[name]
        if dataclasses.is_dataclass(tp):
            kwargs[name] = _build(tp, value, f"{prefix}{name}.")
        else:
            kwargs[name] = _coerce(value, tp, f"{prefix}{name}")
    return cls(**kwargs)


def _parse_scalar(text: str) -> Any:
    """A command-line value is read as YAML: `3e-4` -> float, `[1,2]` -> list, `null` -> None."""
    try:
        return yaml.load(text, Loader=_StrictLoader)
    except (yaml.YAMLError, ValueError, RecursionError):  # not YAML, or YAML Python cannot hold: the text
        return text


class _StrictLoader(yaml.SafeLoader):
    """yaml.safe_load that refuses a key given twice in one mapping (PyYAML keeps the last silently, so
    a second `optim:` section would wipe out the first)."""


def _construct_unique_mapping(loader: yaml.SafeLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: dict = {}
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":
            continue
        key = loader.construct_object(key_node, deep=True)
        line = key_node.start_mark.line + 1
        try:
            first = seen.get(key)
        except TypeError:  # unhashable: construct_mapping reports it
            continue
        if first is not None:
            raise ConfigError(f"config key '{key}' is given twice (lines {first} and {line}); "
                              "the second would silently replace the first: merge them")
        seen[key] = line
    return loader.construct_mapping(node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_unique_mapping)


def _apply_override(tree: dict, item: str, renamed: Optional[str] = None) -> None:
    """`renamed`: the dotted key to set instead of the one `item` names (an old key's new name)."""
    if "=" not in item:
        raise ConfigError(f"override {_quoted(item)} must look like section.key=value (e.g. optim.lr=3e-4)")
    dotted, raw = item.split("=", 1)
    parts = (renamed or dotted.strip()).split(".")
    node = tree
    for part in parts[:-1]:
        child = node.get(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {_quoted(item)}: {_quoted(part)} is not a section")
        node[part] = child = dict(child)  # copy on the way down: the caller's dict is never changed
        node = child
    value = _parse_scalar(raw)
    # yaml reads "1e-4" as a string; accept it as a number where a float is meant.
    if isinstance(value, str) and any(c in value for c in ".eE"):
        with contextlib.suppress(ValueError):
            value = float(value)
    node[parts[-1]] = value


# ---------------------------------------------------------------------------- the architectures' sections
# Each registered architecture may declare its own keys (`registry.Options`, in its package's torch-free
# options.py): a top-level section named after it, built here beside the generic ones, accepted only when
# drafter.architecture names it, and handed to its code as `Config.options`.


def old_key_names() -> dict[str, str]:
    """Old flat key -> its key now, e.g. `drafter.X` -> `NAME.X` (the architectures' `Options.aliases`)."""
    return {old: f"{name}.{new}" for name, o in _sections().items() for old, new in o.aliases.items()}


_aliases = old_key_names


def _move_aliases(tree: dict, moved: dict[str, str]) -> dict:
    """`tree` with the old flat keys it holds moved into their architecture's section (a copy: sections are copied
    when changed); `moved` gets new key -> old key for each."""
    tree = dict(tree)
    for old, new in _aliases().items():
        section, key = old.split(".")
        body = tree.get(section)
        if not isinstance(body, dict) or key not in body:
            continue
        new_section, new_key = new.split(".")
        target = tree.get(new_section)
        if target is not None and not isinstance(target, dict):
            continue  # the section itself is malformed: _build names it
        if isinstance(target, dict) and new_key in target:
            raise ConfigError(f"config key '{old}' is the old name of '{new}', which is given too: remove '{old}'")
        body = dict(body)
        value = body.pop(key)
        tree[section] = body
        tree[new_section] = {**(target or {}), new_key: value}
        moved[new] = old
    return tree


def _build_config(tree: dict, final: bool = False, moved: Optional[dict[str, str]] = None) -> Config:
    """The generic sections, and each architecture section present (types and ranges). `final`: also refuse a
    section whose architecture drafter.architecture does not name, and set `options` (the defaults when absent).
    A section made only of old flat keys at their defaults (`moved`), as every config.yaml written before the
    sections holds for each architecture, is dropped instead of refused."""
    sections = _sections()
    cfg = _build(Config, {k: v for k, v in tree.items() if k not in sections}, "", tuple(sections))
    built = {name: _build(o.section, tree[name], f"{name}.") for name, o in sections.items() if name in tree}
    for name, section in built.items():
        _check_section_numbers(name, sections[name], section)
    if not final:
        return cfg
    arch = cfg.drafter.architecture
    for name, section in built.items():
        if name == arch:
            continue
        given = tree[name] or {}
        default = sections[name].section()
        off = [k for k in given if getattr(section, k) != getattr(default, k)]
        if given and not off and all(f"{name}.{k}" in (moved or {}) for k in given):
            continue  # an old config.yaml's flat keys at their defaults: they never applied to this architecture
        key = (off or list(given) or [""])[0]
        dotted = f"{name}.{key}" if key else name
        old = (moved or {}).get(dotted)
        what = sections[name].about or f"the {name} architecture"
        fix = (f"leave {old} at {getattr(default, key)!r} (or remove it)" if old else f"remove the {name} section")
        raise ConfigError(f"config key '{dotted}': applies to {what}; drafter.architecture is {arch!r}: set "
                          f"drafter.architecture={name} or {fix}")
    if arch in sections:
        cfg.options = built.get(arch) or sections[arch].section()
    for dotted, value in (sections[arch].defaults if arch in sections else {}).items():
        section, key = dotted.split(".", 1)
        if key not in (tree.get(section) or {}):
            setattr(getattr(cfg, section), key, value)
    return cfg


_WARNED: set[tuple[str, ...]] = set()


def _warn_renamed(moved: dict[str, str], cfg: Config, source: Optional[str], given: dict[str, str]) -> None:
    """One warning line per config (per process: a resume reads the run's config.yaml twice) for its old keys,
    each named with where it was written: the file `source`, or the override of `given` (new key -> override)."""
    if not moved or tuple(sorted(moved)) in _WARNED:
        return
    _WARNED.add(tuple(sorted(moved)))
    arch = cfg.drafter.architecture

    def where(new: str) -> str:
        dotted = given.get(new, "").split("=", 1)[0].strip()
        if dotted == moved[new]:
            return f" (override {_quoted(given[new])})"
        return f" (in {source})" if source else ""

    renamed = ", ".join(f"{old} -> {new}{where(new)}" for new, old in moved.items() if new.startswith(f"{arch}."))
    ignored = ", ".join(f"{old}{where(new)}" for new, old in moved.items() if not new.startswith(f"{arch}."))
    parts = ([f"read under their new names: {renamed}"] if renamed else []) + (
        [f"ignored (at their defaults; drafter.architecture is {arch!r}): {ignored}"] if ignored else [])
    log.warning("deprecated config keys %s; write an architecture's keys in its own section", "; ".join(parts))


def _renamed(message: str, moved: dict[str, str]) -> str:
    """A message about a key given under its old name names that name (and the new one)."""
    named = re.search(r"config key '([^']+)'", message)
    if named and named.group(1) in moved:
        new = named.group(1)
        return message.replace(f"config key '{new}'", f"config key '{moved[new]}' (now {new})", 1)
    return message


def config_from_dict(data: dict, overrides: list[str] | None = None, source: str | None = None) -> Config:
    """The config of `data` (a parsed YAML file, `source` names it in messages) with dotted overrides
    applied. An error is blamed on what caused it: the file, the override, or (a cross-field check) the
    override that set the key it names, else the file. Old flat keys of an architecture's section are read
    under their new names (one warning)."""
    if data is not None and not isinstance(data, dict):
        raise ConfigError(f"config section 'the top level' must be a mapping, got {type(data).__name__}")
    suffix = f" ({source})" if source else ""
    moved: dict[str, str] = {}
    try:
        # overrides copy the sections they change; nothing else is ever mutated
        tree = _move_aliases(data or {}, moved)
        _build_config(tree)
    except ConfigError as e:
        raise ConfigError(f"{_renamed(str(e), moved)}{suffix}") from None
    given: dict[str, str] = {}
    aliases = _aliases()
    for item in overrides or []:
        dotted = item.split("=", 1)[0].strip()
        new = aliases.get(dotted)
        try:
            _apply_override(tree, item, new)
            _build_config(tree)
        except ConfigError as e:
            message = _renamed(str(e), {**moved, **({new: dotted} if new else {})})
            named = message if message.startswith("override ") else f"override {_quoted(item)}: {message}"
            raise ConfigError(named) from None
        if new:
            moved[new] = dotted
        elif dotted in moved:  # the file's old key, set again under its new name
            del moved[dotted]
        given[new or dotted] = item
    try:
        cfg = _build_config(tree, final=True, moved=moved)
        validate(cfg)
    except ConfigError as e:
        named = re.match(r"config key '([^']+)'", str(e))
        item = given.get(named.group(1)) if named else None
        message = _renamed(str(e), moved)
        if item:
            raise ConfigError(f"{message} (override {_quoted(item)})") from None
        # a cross-field check names the key it refuses; the other key it names may be an override's
        other = next((o for key, o in given.items() if re.search(rf"\b{re.escape(key)}\b", message)), None)
        if other is None:
            raise ConfigError(f"{message}{suffix}") from None
        both = f"{source} with the override" if source else "override"
        raise ConfigError(f"{message} ({both} {_quoted(other)})") from None
    _warn_renamed(moved, cfg, source, given)
    return cfg


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> Config:
    data: dict = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file not found: {p}")
        try:
            data = yaml.load(p.read_bytes().decode("utf-8"), Loader=_StrictLoader) or {}
        except UnicodeDecodeError as e:
            raise ConfigError(f"config file {p} is not UTF-8 text (invalid byte at offset {e.start})") from None
        except ConfigError as e:
            raise ConfigError(f"{e} ({p})") from None
        except (yaml.YAMLError, ValueError, RecursionError) as e:  # ValueError: e.g. an int of > 4300 digits
            what = "nested too deeply" if isinstance(e, RecursionError) else str(e)
            raise ConfigError(f"config file {p} is not valid YAML: {what}") from None
        except OSError as e:
            raise ConfigError(f"config file {p} cannot be read: {e.strerror or e}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"config file {p} must hold a mapping of sections, got {type(data).__name__}")
    return config_from_dict(data, overrides, str(path) if path else None)


def config_to_dict(cfg: Config) -> dict:
    """The config as plain YAML data: the generic sections, then drafter.architecture's own (when it has one)."""

    def plain(v: Any) -> Any:
        if isinstance(v, tuple):
            return [plain(x) for x in v]
        if isinstance(v, list):
            return [plain(x) for x in v]
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        return v

    out = {f.name: plain(dataclasses.asdict(getattr(cfg, f.name))) for f in _section_fields()}
    if cfg.options is not None:
        out[cfg.drafter.architecture] = plain(dataclasses.asdict(cfg.options))
    return out


def dump_config(cfg: Config, path: Path) -> None:
    write_text_atomic(path, yaml.safe_dump(config_to_dict(cfg), sort_keys=False))
