"""Property-based fuzzing (hypothesis) of the two places dirty input enters: `prepare` and config loading.

prepare: random JSON values per line, random row shapes (messages / conversations / prompt with random
types and contents), random bytes (invalid UTF-8 included), truncated JSON, JSON arrays and gzip, mixed
in one call. It never raises anything but the documented "no usable row" ValueError, and every input
row is accounted for: kept + rejected == rows read == rows in the input (blank JSONL lines are not rows),
and rejects.jsonl holds one line per rejected row.

config: random nested mappings of random keys, types and values, random dotted overrides, random YAML
text and bytes: the result is a valid Config or a ConfigError whose message names the key (or the file)
at fault, never another exception. A Config that loads has only finite floats and 64-bit ints.

Every crash found so far is pinned below as an @example. Example counts scale with
DFLASH_FUZZ_EXAMPLES (a multiplier, default 1); DFLASH_FUZZ_RANDOM=1 draws new examples each run
(default: derandomized, the same examples every run). Long sweep:
    DFLASH_FUZZ_EXAMPLES=20 DFLASH_FUZZ_RANDOM=1 pytest tests/fault/test_fuzz.py --hypothesis-show-statistics
"""

from __future__ import annotations

import copy
import gzip
import json
import math
import os
import pickle
import re
import shutil
import tempfile
from dataclasses import fields, is_dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from dflash_train.config.load import config_from_dict, config_to_dict, load_config
from dflash_train.config.schema import Config
from dflash_train.errors import ConfigError
from dflash_train.commands.prepare import PrepareConfig, prepare
from dflash_train.target.capture import load_tokenizer

SCALE = float(os.environ.get("DFLASH_FUZZ_EXAMPLES", "1"))
RANDOM = bool(os.environ.get("DFLASH_FUZZ_RANDOM"))  # default: the same examples every run (stable CI)


def fuzz_settings(n: int):
    return settings(deadline=None, max_examples=max(1, int(n * SCALE)), derandomize=not RANDOM,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                           HealthCheck.data_too_large])


@pytest.fixture(scope="module")
def tok(tokenizer_dir):
    return load_tokenizer(tokenizer_dir)


# ============================================================================ prepare: strategies

json_scalars = (st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20))
json_values = st.recursive(json_scalars, lambda kids: st.lists(kids, max_size=4)
                           | st.dictionaries(st.text(max_size=8), kids, max_size=4), max_leaves=12)

WORDS = ["apple", "river", "stone", "cloud", "maple", "ember", "quartz", "the", "of", "runs"]
prose = st.lists(st.sampled_from(WORDS), min_size=1, max_size=30).map(" ".join)
contents = (prose | st.text(max_size=40) | st.just("") | st.just("   ") | st.just("\ud800 lone surrogate")
            | st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image"]), "text": prose}), max_size=3)
            | json_values)
roles = st.sampled_from(["system", "user", "assistant", "tool", "", "USER"]) | json_values
senders = st.sampled_from(["human", "gpt", "system", "user", "assistant", "chatgpt", "bard", "bing", "model",
                           "GPT", "robot"]) | json_values


def _maybe_drop(d: dict, drop: list[str]) -> dict:
    return {k: v for k, v in d.items() if k not in drop}


turn_openai = st.builds(_maybe_drop, st.fixed_dictionaries({"role": roles, "content": contents}),
                        st.lists(st.sampled_from(["role", "content"]), max_size=1)) | json_values
turn_sharegpt = st.builds(_maybe_drop, st.fixed_dictionaries({"from": senders, "value": contents}),
                          st.lists(st.sampled_from(["from", "value"]), max_size=1)) | json_values


@st.composite
def good_rows(draw) -> dict:
    """A conversation that should be kept (with block_size 2: >= 4 supervised tokens)."""
    n = draw(st.integers(1, 3))
    turns = []
    if draw(st.booleans()):
        turns.append({"role": "system", "content": draw(prose)})
    for _ in range(n):
        turns += [{"role": "user", "content": draw(prose)},
                  {"role": "assistant", "content": " ".join(WORDS[:4]) + " " + draw(prose)}]
    return {"messages": turns}


rows = st.one_of(
    good_rows(),
    st.fixed_dictionaries({"messages": st.lists(turn_openai, max_size=5) | json_values}),
    st.fixed_dictionaries({"conversations": st.lists(turn_sharegpt, max_size=5) | json_values}),
    st.fixed_dictionaries({"prompt": contents}, optional={"response": contents, "extra": json_values}),
    st.dictionaries(st.text(max_size=10), json_values, max_size=3),
    json_values,
)


def _dumps(row) -> bytes:
    return json.dumps(row, ensure_ascii=False).encode("utf-8", "surrogatepass")


# A JSONL line: a row, a random JSON value, truncated JSON, or random bytes (may hold newlines: more lines).
jsonl_lines = st.one_of(
    rows.map(_dumps),
    rows.map(_dumps).flatmap(lambda b: st.integers(0, max(len(b) - 1, 0)).map(lambda k: b[:k])),
    st.binary(max_size=40),
    st.sampled_from([b"", b"   ", b"\xef\xbb\xbf", b"\xff\xfe\x00", b"\x80abc", b"nan", b"[]", b"{}", b"\r"]),
)
# A JSON array element: a row, or a string with bytes that are not UTF-8 (only that element is spoilt).
array_elements = st.one_of(
    rows.map(_dumps),
    st.binary(min_size=1, max_size=12).map(
        lambda b: b'"' + bytes(c for c in b if c >= 0x80 or (0x20 <= c and c not in b'"\\')) + b'\xff"'),
)
parquet_rows = st.one_of(
    good_rows(),
    st.fixed_dictionaries({"messages": st.lists(st.fixed_dictionaries(
        {"role": st.none() | st.sampled_from(["user", "assistant", "bot"]), "content": st.none() | prose}), max_size=4)}),
    st.fixed_dictionaries({"prompt": st.none() | prose, "response": st.none() | prose}),
)

files_st = st.lists(st.one_of(
    st.tuples(st.just("jsonl"), st.lists(jsonl_lines, max_size=12), st.booleans()),
    st.tuples(st.just("jsonl.gz"), st.lists(jsonl_lines, max_size=12), st.booleans()),
    st.tuples(st.just("json"), st.lists(array_elements, max_size=10), st.booleans()),
    st.tuples(st.just("parquet"), st.lists(parquet_rows, min_size=1, max_size=8), st.booleans()),
), min_size=1, max_size=3)


def _jsonl_rows(content: bytes) -> int:
    """Rows in a JSONL file, by the documented rule: every line is a row except blank ones."""
    lines = content.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    n = 0
    for i, raw in enumerate(lines, 1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError:
            n += 1
            continue
        if i == 1:
            line = line.lstrip("\ufeff")
        n += bool(line.strip())
    return n


def _jsonl_cut(content: bytes) -> bool:
    """A JSONL file that reads as damaged, by the documented rule: its last line has no newline and does not
    parse (or ends inside a UTF-8 character)."""
    if content.endswith(b"\n"):
        return False
    last = content.split(b"\n")[-1]
    try:
        line = last.decode("utf-8")
    except UnicodeDecodeError as e:
        return e.reason == "unexpected end of data"
    if b"\n" not in content:
        line = line.lstrip("\ufeff")
    if not line.strip():
        return False
    try:
        json.loads(line)
    except json.JSONDecodeError:
        return True
    except (ValueError, RecursionError):
        return False
    return False


def _write_inputs(root: Path, files) -> tuple[list[str], int, list[str]]:
    """The files on disk, the number of rows they hold and those that read as damaged (empty or cut)."""
    specs, total, damaged = [], 0, []
    for k, (kind, payload, trailing) in enumerate(files):
        path = root / f"in-{k}.{kind}"
        if kind in ("jsonl", "jsonl.gz"):
            content = b"\n".join(payload) + (b"\n" if trailing else b"")
            path.write_bytes(gzip.compress(content, mtime=0) if kind.endswith(".gz") else content)
            rows = _jsonl_rows(content)
            total += rows
            if not rows or _jsonl_cut(content):  # no row at all (empty, or blank lines only) reads as damaged too
                damaged.append(str(path))
        elif kind == "json":
            sep = b",\n" if trailing else b","
            path.write_bytes(b"[" + sep.join(payload) + b"]")
            total += len(payload)
        else:
            table = pa.Table.from_pylist(payload)
            pq.write_table(table, path)
            total += len(payload)
        specs.append(str(path))
    return specs, total, damaged


def _check_prepare(tok, files, shard_rows: int) -> None:
    from dflash_train.data.formats import DamagedDataFile

    root = Path(tempfile.mkdtemp(prefix="fuzz-prepare-"))
    try:
        specs, expected, damaged = _write_inputs(root, files)
        out = root / "out"
        cfg = PrepareConfig(max_length=64, block_size=2, val_fraction=0.3, shard_rows=shard_rows)
        if damaged:  # the first damaged file stops prepare, naming it; nothing is written
            with pytest.raises(DamagedDataFile) as e:
                prepare(tok, "tiny", specs, out, cfg)
            assert e.value.path == damaged[0], (str(e.value), damaged)
            assert not out.exists() and not list(root.glob(".out.prepare-*"))
            event("prepare: damaged file")
            return
        try:
            manifest = prepare(tok, "tiny", specs, out, cfg)
        except ValueError as e:  # the documented failures: nothing usable at all, or one input gave nothing
            msg = str(e)
            unused = re.match(r"--data (\S+) gave no usable row \(", msg)
            if unused:
                assert unused.group(1) in specs and len(specs) > 1, msg
            else:
                assert msg.startswith("no usable row"), msg
                assert (f"({expected} read;" if expected else "(0 rows read: it holds none)") in msg, (expected, msg)
            assert not out.exists()
            assert not list(root.glob(".out.prepare-*")), "temp dir left behind"
            event("prepare: an input gave no usable row" if unused else "prepare: no usable row")
            return
        c = manifest["counts"]
        event("prepare: some rows kept")
        for reason in c["rejected"]:
            event(f"rejected: {reason}")
        assert c["rows_read"] == expected, (c, expected)
        assert c["kept"] + c["rejected_total"] == expected, c
        assert sum(c["rejected"].values()) == c["rejected_total"]
        s = manifest["splits"]
        assert s["train"]["rows"] + s["val"]["rows"] == c["kept"]
        rejects = [json.loads(line) for line in (out / "rejects.jsonl").read_text(encoding="utf-8").splitlines()]
        assert len(rejects) == c["rejected_total"]
        assert all(set(r) == {"where", "reason", "detail"} and r["where"].startswith(str(root)) for r in rejects)
        assert (out / "manifest.json").is_file() and not list(root.glob(".out.prepare-*"))
        from dflash_train.data.store import PreparedDataset

        assert len(PreparedDataset(out, "train")) + len(PreparedDataset(out, "val")) == c["kept"]
    finally:
        shutil.rmtree(root, ignore_errors=True)


GOOD = _dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": " ".join(WORDS)}]})


@fuzz_settings(60)
@given(files=files_st, shard_rows=st.integers(1, 4))
# Regressions. A JSON integer of more than 4300 digits raised ValueError from json.loads, which stopped the
# whole file as "unreadable" (every later row lost, counts off); JSON nested deeper than the recursion limit
# raised RecursionError out of prepare. Both are now one rejected row.
@example(files=[("jsonl", [GOOD, b"1" * 5000, b'{"prompt": ' + b"9" * 5000 + b"}", GOOD], True)], shard_rows=1)
@example(files=[("jsonl", [GOOD, b"[" * 100_000 + b"]" * 100_000, GOOD], False)], shard_rows=2)
@example(files=[("json", [GOOD, b"[" * 100_000 + b"]" * 100_000, b"7" * 5000, b'{"a": "]\\"}", "b": ' + b"1" * 5000 + b"}",
                          GOOD], True)], shard_rows=3)
# An unknown role or sender that is a deep structure: its repr in the reject detail must stay bounded.
@example(files=[("jsonl", [_dumps({"conversations": [{"from": [[[[[[[["x" * 10_000]]]]]]]], "value": "v"}]}),
                           _dumps({"messages": [{"role": {"a": [1] * 10_000}, "content": "c"}]}), GOOD], True)],
         shard_rows=1)
@example(files=[("jsonl.gz", [b"\xff\xfe", GOOD, b"", b"\xef\xbb\xbf" + GOOD], False)], shard_rows=1)
# A .jsonl file whose first row starts with '[' was read as one JSON array: `[]` gave 0 rows, `[1, 2]` hid
# every later line without a word. A .jsonl file is now always read line by line.
@example(files=[("jsonl", [b"[]"], False)], shard_rows=1)
@example(files=[("jsonl", [b"[1, 2]", GOOD, GOOD], True)], shard_rows=1)
def test_prepare_never_crashes_and_counts_every_row(tok, files, shard_rows):
    _check_prepare(tok, files, shard_rows)


def test_data_after_a_json_array_is_reported_not_silently_dropped(tmp_path):
    from dflash_train.data.formats import RowError, iter_rows

    f = tmp_path / "two.json"
    f.write_bytes(b"[" + GOOD + b"]\n[" + GOOD + b"]\n")
    got = [(w, r.reason if isinstance(r, RowError) else "ok") for w, r in iter_rows(f)]
    assert got == [(f"{f}:#0", "ok"), (f"{f}:#1", "invalid JSON")]


def test_prepare_keeps_the_rows_before_a_gzip_cut_only_when_asked(tok, tmp_path):
    """A gzip cut mid-stream is a damaged file, not a rejected row: prepare stops naming it; with
    skip_damaged_files the rows before the cut are kept, the file is listed, the other files are untouched."""
    from dflash_train.data.formats import DamagedDataFile

    rows = [_dumps({"messages": [{"role": "user", "content": f"hi {i}"},
                                 {"role": "assistant", "content": " ".join(WORDS[i % 7:] + [str(i)])}]})
            for i in range(200)]
    content = gzip.compress(b"\n".join(rows) + b"\n", mtime=0)
    (tmp_path / "cut.jsonl.gz").write_bytes(content[: len(content) // 2])
    (tmp_path / "ok.jsonl").write_bytes(GOOD + b"\n" + GOOD + b"\n")
    specs = [str(tmp_path / "cut.jsonl.gz"), str(tmp_path / "ok.jsonl")]
    with pytest.raises(DamagedDataFile, match="gzip stream ends early"):
        prepare(tok, "tiny", specs, tmp_path / "out", PrepareConfig(max_length=64, block_size=2, val_fraction=0.0))
    m = prepare(tok, "tiny", specs, tmp_path / "out",
                PrepareConfig(max_length=64, block_size=2, val_fraction=0.0, skip_damaged_files=True))
    c = m["counts"]
    [damaged] = c["damaged_files"]
    assert c["rejected"] == {} and c["kept"] == c["rows_read"] == damaged["rows_read"] + 2 and damaged["rows_read"] > 0


# ============================================================================= config: strategies


def _schema(cls=Config, prefix="") -> dict[str, object]:
    """Dotted key -> annotation, for every leaf of the config tree."""
    import typing

    out = {}
    hints = typing.get_type_hints(cls)
    for f in fields(cls):
        if not f.metadata.get("section", True):  # Config.options: not a YAML key
            continue
        tp = hints[f.name]
        if is_dataclass(tp):
            out[f"{prefix}{f.name}"] = tp
            out.update(_schema(tp, f"{prefix}{f.name}."))
        else:
            out[f"{prefix}{f.name}"] = tp
    return out


SCHEMA = _schema()
SECTIONS = sorted(k for k in SCHEMA if "." not in k)
LEAVES = sorted(k for k in SCHEMA if "." in k)

weird_scalars = (json_scalars | st.integers(min_value=-(2**80), max_value=2**80)
                 | st.sampled_from([math.inf, -math.inf, math.nan, 1e308, -0.0, 2**63, 2**63 - 1, -(2**63),
                                    "1e-4", "3E5", "6.0e-4", "true", "null", "auto", "cpu", "bfloat16", "~", "",
                                    "[1, 2]", "0x10", "1_000"]))
values = st.recursive(weird_scalars, lambda kids: st.lists(kids, max_size=3)
                      | st.dictionaries(st.text(max_size=6) | st.integers(), kids, max_size=3), max_leaves=8)
keys = st.sampled_from(SECTIONS + [k.split(".")[1] for k in LEAVES]) | st.text(max_size=8) | st.integers()


def _typed(tp) -> st.SearchStrategy:
    """Values of the right type for an annotation (the cross-field checks may still refuse them)."""
    import typing

    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Literal:
        return st.sampled_from(args)
    if origin is typing.Union or str(origin) == "<class 'types.UnionType'>":
        return st.one_of([_typed(a) for a in args])
    if tp is type(None):
        return st.none()
    if origin is list:
        return st.lists(_typed(args[0]), max_size=4)
    if origin is tuple:
        return st.tuples(*[_typed(a) for a in args])
    if tp is bool:
        return st.booleans()
    if tp is int:
        return st.integers(0, 64) | st.integers(-(2**63), 2**63 - 1)
    if tp is float:
        return st.floats(0, 1, exclude_max=True) | st.floats(allow_nan=False)
    if tp is str:
        return st.text(max_size=12)
    return values


@st.composite
def config_trees(draw) -> dict:
    """Real sections and keys with values of the right type (half of the trees), or with random values,
    random keys and random sections."""
    typed = draw(st.booleans())
    tree: dict = {}
    for section in draw(st.lists(st.sampled_from(SECTIONS) if typed else st.sampled_from(SECTIONS) | keys, max_size=4)):
        if not typed and draw(st.integers(0, 4)) == 0:
            tree[section] = draw(values)
            continue
        leaves = [k.split(".")[1] for k in LEAVES if k.startswith(f"{section}.")]
        body = {}
        pick = st.sampled_from(leaves) if typed and leaves else (st.sampled_from(leaves) | keys if leaves else keys)
        for key in draw(st.lists(pick, max_size=4)):
            tp = SCHEMA.get(f"{section}.{key}")
            body[key] = draw(_typed(tp) if typed and tp is not None else values)
        tree[section] = body
    return tree


def _yaml_value(v) -> str:
    try:
        return yaml.safe_dump(v, default_flow_style=True).strip().removesuffix("...").strip()
    except yaml.YAMLError:
        return str(v)


overrides_st = st.lists(st.one_of(
    st.tuples(st.sampled_from(LEAVES + SECTIONS) | st.text(max_size=12), values.map(_yaml_value)).map("=".join),
    st.tuples(st.sampled_from(LEAVES), st.text(max_size=12)).map("=".join),
    st.text(max_size=20),
), max_size=4)


def _paths(tree, prefix="") -> set[str]:
    out = set()
    if isinstance(tree, dict):
        for k, v in tree.items():
            out.add(f"{prefix}{k}")
            if not prefix:
                out |= _paths(v, f"{k}.")
    return out


def _names_a_key(msg: str, tree, overrides: list[str]) -> bool:
    candidates = set(SCHEMA) | _paths(tree) | {"the top level"}
    for item in overrides:
        candidates.add(item)
        dotted, _, raw = item.partition("=")
        parts = dotted.strip().split(".")
        candidates |= {".".join(parts[: i + 1]) for i in range(len(parts))} | set(parts)
        try:
            value = yaml.safe_load(raw)
        except Exception:
            value = None
        if isinstance(value, dict):  # `data={max_length: 3}` sets keys of the section
            candidates |= {f"{dotted.strip()}.{k}" for k in value}
    return any(f"'{c}'" in msg or f"'{c}[" in msg for c in candidates)


def _check_config(cfg: Config) -> None:
    """What loaded is runnable: finite floats, 64-bit ints, and the config round-trips through YAML."""
    def walk(v, key):
        if isinstance(v, bool) or v is None or isinstance(v, str):
            return
        if isinstance(v, float):
            assert math.isfinite(v), key
        elif isinstance(v, int):
            assert -(2**63) <= v < 2**63, key
        elif isinstance(v, (list, tuple)):
            for x in v:
                walk(x, key)
        elif isinstance(v, dict):
            for k, x in v.items():
                walk(x, f"{key}.{k}")
    plain = config_to_dict(cfg)
    walk(plain, "")
    assert config_to_dict(config_from_dict(yaml.safe_load(yaml.safe_dump(plain)))) == plain


@fuzz_settings(400)
@given(tree=config_trees(), overrides=overrides_st)
# Regressions: a > 4300-digit int or deeply nested YAML in an override raised ValueError / RecursionError;
# an int beyond int64 (seed) and an infinite float (epochs) loaded and then crashed the trainer.
@example(tree={}, overrides=["optim.lr=" + "1" * 5000])
@example(tree={}, overrides=["optim.lr=" + "[" * 3000 + "]" * 3000])
@example(tree={"run": {"seed": 2**64}}, overrides=[])
@example(tree={"optim": {"epochs": math.inf}}, overrides=[])
@example(tree={"optim": {"lr": 10**5000}}, overrides=[])
@example(tree={"optim": {"lr": "3e-4"}}, overrides=["optim.eps=1e-9"])
@example(tree={"optim": None}, overrides=["optim.lr=1"])
@example(tree={"optim": {"lr": [[[[[[[[["x" * 100_000]]]]]]]]]}}, overrides=[])
@example(tree={}, overrides=["data={? '' : null}"])
def test_config_from_dict_gives_a_config_or_a_named_error(tree, overrides):
    before = pickle.dumps(tree)
    try:
        cfg = config_from_dict(tree, overrides)
    except ConfigError as e:
        msg = str(e)
        event("config: ConfigError")
        assert _names_a_key(msg, tree, overrides), msg
        assert len(msg) < 2000, len(msg)
    else:
        event("config: valid")
        _check_config(cfg)
    assert pickle.dumps(tree) == before, "the caller's dict was changed"


yaml_texts = st.one_of(
    config_trees().map(lambda t: yaml.safe_dump(t, allow_unicode=True)).map(lambda s: s.encode("utf-8")),
    st.text(max_size=200).map(lambda s: s.encode("utf-8", "surrogatepass")),
    st.binary(max_size=100),
    st.sampled_from([b"optim: {lr: 1.0e-3, lr: 2.0e-3}\n", b"optim:\n  lr: 1.0\noptim:\n  epochs: 2\n",
                     b"optim:\n  lr: " + b"1" * 5000 + b"\n", b"[" * 600 + b"]" * 600, b"\xff\xfe\x00x",
                     b"optim: {lr: &a [*a]}\n", b"- 1\n- 2\n", b"optim: !!python/object:os.system {}\n",
                     b"? [1, 2]\n: 3\n", b"run: {seed: !!float 1}\n", b"optim:\n  lr: 3e-4\n"]),
)


@fuzz_settings(200)
@given(content=yaml_texts, overrides=overrides_st)
def test_load_config_gives_a_config_or_a_named_error(content, overrides):
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "c.yaml"
        path.write_bytes(content)
        try:
            cfg = load_config(path, overrides)
        except ConfigError as e:
            msg = str(e)
            event("load_config: ConfigError")
            # every error names its cause: the file, or the override at fault (never the file for an override's)
            assert str(path) in msg or (overrides and (msg.startswith("override ") or "(override " in msg)), msg
            try:
                tree = yaml.safe_load(content.decode("utf-8"))
            except Exception:
                tree = {}
            keys_named = _names_a_key(msg, tree if isinstance(tree, dict) else {}, overrides)
            assert keys_named or msg.startswith(f"config file {path}") or " is given twice " in msg, msg
        else:
            event("load_config: valid")
            _check_config(cfg)


def test_duplicate_keys_in_a_config_file_are_refused(tmp_path):
    """PyYAML keeps the last of two equal keys: a second `optim:` section silently replaced the first."""
    p = tmp_path / "c.yaml"
    p.write_text("optim:\n  lr: 1.0e-3\nrun:\n  seed: 1\noptim:\n  epochs: 2\n")
    with pytest.raises(ConfigError, match=r"'optim' is given twice \(lines 1 and 5\).*c\.yaml"):
        load_config(p)


def test_exponent_floats_without_a_dot_load_from_files(tmp_path):
    """YAML 1.1 reads `3e-4` as a string; float keys take it as the number it means (ints stay strict)."""
    p = tmp_path / "c.yaml"
    p.write_text("optim:\n  lr: 3e-4\n  eps: 1E-9\n")
    cfg = load_config(p)
    assert cfg.optim.lr == 3e-4 and cfg.optim.eps == 1e-9
    p.write_text("drafter:\n  block_size: 1e1\n")
    with pytest.raises(ConfigError, match="drafter.block_size"):
        load_config(p)


def test_config_from_dict_never_changes_its_argument():
    tree = {"optim": {"lr": 1e-3}}
    snapshot = copy.deepcopy(tree)
    config_from_dict(tree, ["optim.lr=2e-3", "run.seed=4"])
    assert tree == snapshot
