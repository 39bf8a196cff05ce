"""`dflash-train prepare` on the real SmolLM2 tokenizer: row shapes, masks, bad rows, file formats,
determinism, atomic output, bounded memory, and the memory-mapped reader."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dflash_train.cli import main
from dflash_train.data.dataset import tokenize_row
from dflash_train.data.formats import RowError, iter_rows, to_messages
from dflash_train.commands.prepare import PrepareConfig, holdout_key, prepare
from dflash_train.data.store import PreparedDataset
from dflash_train.target.fingerprints import chat_template_fingerprint, tokenizer_fingerprint
from dflash_train.target.capture import load_tokenizer

END = "<|im_end|>\n"


@pytest.fixture(scope="module")
def tok(tokenizer_dir):
    return load_tokenizer(tokenizer_dir)


def supervised(tok, ex) -> str:
    return tok.decode(ex.input_ids[ex.loss_mask.astype(bool)])


def words(n: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(["apple", "river", "stone", "cloud", "maple", "ember", "quartz"]) for _ in range(n))


def openai(user: str, answer: str, system: str | None = None) -> dict:
    msgs = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": user}, {"role": "assistant", "content": answer}]
    return {"messages": msgs}


def all_files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


# ------------------------------------------------------------------------------- shapes and masks


A1, A2 = words(20, 1), words(25, 2)


@pytest.mark.parametrize("row,answers,system", [
    ({"conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Q1?"},
                        {"from": "gpt", "value": A1}, {"from": "human", "value": "Q2?"}, {"from": "gpt", "value": A2}]},
     [A1, A2], "Be brief."),
    ({"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Q1?"},
                   {"role": "assistant", "content": A1}, {"role": "user", "content": "Q2?"},
                   {"role": "assistant", "content": A2}]}, [A1, A2], "Be brief."),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "Q1?"}]},
                   {"role": "assistant", "content": [{"type": "text", "text": A1}]}]}, [A1], None),
    ({"prompt": "Q1?", "response": A1}, [A1], None),
    # a trailing user turn after the last answer teaches nothing: it is dropped
    ({"conversations": [{"from": "human", "value": "Q1?"}, {"from": "gpt", "value": A1},
                        {"from": "human", "value": "Q2?"}]}, [A1], None),
], ids=["sharegpt-multi-turn-system", "openai-multi-turn-system", "openai-content-parts", "prompt-response",
        "trailing-user"])
def test_each_shape_supervises_exactly_the_assistant_turns(tok, row, answers, system):
    ex, messages, truncated = tokenize_row(tok, row, max_length=4096, block_size=2)
    assert not truncated and messages[-1]["role"] == "assistant"
    assert supervised(tok, ex) == "".join(a + END for a in answers)
    text = tok.decode(ex.input_ids)
    assert text == tok.apply_chat_template(messages, tokenize=False)
    if system:
        assert text.startswith(f"<|im_start|>system\n{system}<|im_end|>")
    assert ex.input_ids.dtype == np.int32 and ex.loss_mask.dtype == np.uint8


def test_prompt_only_rows_are_for_regen(tok):
    assert to_messages({"prompt": "Hi"}) == [{"role": "user", "content": "Hi"}]
    for row in ({"prompt": "Hi"}, {"prompt": "Hi", "response": None}, {"messages": [{"role": "user", "content": "Hi"}]}):
        with pytest.raises(RowError) as e:
            tokenize_row(tok, row, 512, 2)
        assert e.value.reason == "no assistant turn (run regen first)"


# ------------------------------------------------------------------------------------ messy input


def _messy(path: Path) -> tuple[list[str], dict[int, str]]:
    """A JSONL file with every kind of bad row; returns (good answers in order, {line: reason})."""
    good1, good2, good3, long_ok = words(30, 3), words(30, 4), words(30, 5), words(700, 6)
    lines: list[bytes] = []
    bad: dict[int, str] = {}

    def add(obj=None, raw: bytes | None = None, reason: str | None = None):
        lines.append(raw if raw is not None else json.dumps(obj).encode())
        if reason:
            bad[len(lines)] = reason

    add(openai("First?", good1))
    add(raw=b'{"messages": [{"role": "user", "content": "x"}', reason="invalid JSON")
    add({"text": "hello"}, reason="unknown shape")
    add({"messages": []}, reason="missing turns")
    add({"messages": [{"role": "user"}, {"role": "assistant", "content": "x"}]}, reason="missing turns")
    add(openai("Empty?", "   "), reason="empty turn")
    add({"messages": [{"role": "user", "content": 5}, {"role": "assistant", "content": "x"}]}, reason="wrong type")
    add({"messages": "not a list"}, reason="wrong type")
    add(["a", "list"], reason="wrong type")
    add(raw='{"prompt": "caf\u00e9", "response": "'.encode() + b"\xff\xfe bad bytes" + b'"}', reason="not UTF-8")
    add(raw=b'{"prompt": "x", "response": "\\ud800 lone surrogate"}', reason="not UTF-8")
    add(openai("Long?", words(3000, 7)), reason="far over max_length")
    add(openai("Short?", "Yes."), reason="too few supervised tokens")
    add({"conversations": [{"from": "human", "value": "Second?"}, {"from": "gpt", "value": good2}]})
    add(raw=b"   ")  # blank: skipped silently
    add({"messages": [{"role": "user", "content": "x"}, {"role": "robot", "content": "y"}]}, reason="unknown role")
    add({"prompt": "Only a prompt"}, reason="no assistant turn (run regen first)")
    add({"messages": [{"role": "assistant", "content": "x"}, {"role": "user", "content": "y"}]}, reason="bad turn order")
    add({"prompt": "Third?", "response": good3})
    add(openai("Long but fine?", long_ok))  # over max_length, under 4x: truncated and kept
    path.write_bytes(b"\n".join(lines) + b"\n")
    return [good1, good2, good3, long_ok], bad


def test_messy_file_keeps_every_good_row_and_reports_every_bad_row_by_line(tok, tmp_path, capsys):
    src = tmp_path / "messy.jsonl"
    good, bad = _messy(src)
    out = tmp_path / "P"
    manifest = prepare(tok, "t", [str(src)], out, PrepareConfig(max_length=512, block_size=4, val_fraction=0.0))
    rejects = [json.loads(line) for line in (out / "rejects.jsonl").read_text().splitlines()]
    assert [(r["where"], r["reason"]) for r in rejects] == [(f"{src}:{n}", reason) for n, reason in sorted(bad.items())]
    assert all(r["detail"] for r in rejects if r["reason"] != "no assistant turn (run regen first)")
    c = manifest["counts"]
    assert c["kept"] == 4 and c["truncated"] == 1 and c["rejected_total"] == len(bad)
    assert c["rows_read"] == 4 + len(bad)
    ds = PreparedDataset(out, "train")
    assert len(ds) == 4
    texts = [supervised(tok, ds.example(i)) for i in range(4)]
    assert texts[:3] == [g + END for g in good[:3]]
    assert len(ds.example(3).input_ids) == 512 and good[3].startswith(texts[3][:200])
    assert list(ds.lengths[:3]) == [len(ds.example(i).input_ids) for i in range(3)]


def test_cli_prints_counts_per_reason_and_the_rejects_file(tiny_target_dir, tmp_path, capsys):
    src = tmp_path / "messy.jsonl"
    _, bad = _messy(src)
    out = tmp_path / "P"
    rc = main(["prepare", "--target", str(tiny_target_dir), "--data", str(src), "--out", str(out),
               "--max-length", "512", "--block-size", "4"])
    assert rc == 0
    text = capsys.readouterr().out
    assert f"rejected {len(bad)} rows" in text and str(out / "rejects.jsonl") in text
    for reason in set(bad.values()):
        n = sum(1 for r in bad.values() if r == reason)
        assert f"{n:>8}  {reason}" in text, reason


def test_unusable_inputs_stop_with_what_to_do(tiny_target_dir, tmp_path, capsys):
    out = tmp_path / "P"
    assert main(["prepare", "--target", str(tiny_target_dir), "--data", str(tmp_path / "nope.jsonl"), "--out", str(out)]) == 2
    assert "not found" in capsys.readouterr().err
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "a"}\n{"prompt": "b"}\n')
    assert main(["prepare", "--target", str(tiny_target_dir), "--data", str(prompts), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "no usable row" in err and "regen" in err and f"{prompts}:1" in err
    # built-in prompt-only sources are rejected with the same reason
    assert main(["prepare", "--target", str(tiny_target_dir), "--data", "humaneval", "--out", str(out)]) == 2
    assert "no assistant turn (run regen first): 164" in capsys.readouterr().err
    assert not out.exists() and not list(tmp_path.glob(".P.*"))
    # nor does it leave the folders it made for --out
    assert main(["prepare", "--target", str(tiny_target_dir), "--data", str(prompts), "--out",
                 str(tmp_path / "new" / "deeper" / "P")]) == 2
    assert not (tmp_path / "new").exists()
    # an existing output is not replaced without --overwrite
    good = tmp_path / "good.jsonl"
    good.write_text(json.dumps(openai("q", words(40))) + "\n")
    assert main(["prepare", "--target", str(tiny_target_dir), "--data", str(good), "--out", str(out), "--block-size", "4"]) == 0
    assert main(["prepare", "--target", str(tiny_target_dir), "--data", str(good), "--out", str(out), "--block-size", "4"]) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert main(["prepare", "--target", str(tiny_target_dir), "--data", str(good), "--out", str(out), "--block-size", "4",
                 "--overwrite"]) == 0


def test_an_input_that_gives_no_usable_row_is_named_and_refused(tiny_target_dir, tmp_path, capsys):
    """Beside an input that gives rows, one that gives none (prompt-only rows, an empty JSON array) is refused,
    naming it: the dataset would silently lack it. Inputs not reached under --max-samples are not."""
    good, prompts, empty = tmp_path / "good.jsonl", tmp_path / "prompts.jsonl", tmp_path / "empty.json"
    good.write_text("".join(json.dumps(openai(f"q{i}", words(40, i))) + "\n" for i in range(3)))
    prompts.write_text('{"prompt": "a"}\n{"prompt": "b"}\n')
    empty.write_text("[]")
    out = tmp_path / "P"
    base = ["prepare", "--target", str(tiny_target_dir), "--out", str(out), "--block-size", "4"]
    assert main([*base, "--data", str(good), "--data", str(prompts), "--data", str(empty)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert f"--data {prompts} gave no usable row (2 read; rejected: no assistant turn" in err, err
    assert f"{prompts}:1" in err and f"--data {empty} gave no usable row (0 rows read" in err, err
    assert f"--data {good} " not in err and "gave 3 rows" in err and "regen" in err, err
    assert not out.exists() and not list(tmp_path.glob(".P.*"))
    assert main([*base, "--data", str(good), "--data", str(prompts), "--max-samples", "2"]) == 0  # not reached


# ------------------------------------------------------------------------------------ file formats


def test_json_array_parquet_and_gzip_give_the_same_examples(tok, tmp_path):
    rows = [openai(f"Q{i}?", words(30, i)) for i in range(6)]
    rows[2] = {"conversations": [{"from": "human", "value": "Q2?"}, {"from": "gpt", "value": words(30, 2)}]}
    rows[4] = {"prompt": "Q4?", "response": words(30, 4)}
    jsonl = tmp_path / "a.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    arr = tmp_path / "a.json"
    arr.write_text(json.dumps(rows, indent=1))
    import gzip

    gz = tmp_path / "a.jsonl.gz"
    gz.write_bytes(gzip.compress(jsonl.read_bytes()))
    # Parquet: a table with one column per shape (the other columns are null in each row)
    pqf = tmp_path / "a.parquet"
    turn = lambda a, b: pa.list_(pa.struct([(a, pa.string()), (b, pa.string())]))  # noqa: E731
    schema = pa.schema([("messages", turn("role", "content")), ("conversations", turn("from", "value")),
                        ("prompt", pa.string()), ("response", pa.string())])
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), pqf)
    results = {}
    for f in (jsonl, arr, gz, pqf):
        out = tmp_path / f"P-{f.name}"
        prepare(tok, "t", [str(f)], out, PrepareConfig(max_length=512, block_size=4, val_fraction=0.0))
        ds = PreparedDataset(out)
        results[f.name] = [ds.example(i).input_ids.tolist() for i in range(len(ds))]
    assert len(results["a.jsonl"]) == 6
    assert results["a.json"] == results["a.jsonl"] == results["a.jsonl.gz"] == results["a.parquet"]
    assert [w for w, _ in iter_rows(arr)] == [f"{arr}:#{i}" for i in range(6)]
    assert [w for w, _ in iter_rows(pqf)] == [f"{pqf}:#{i}" for i in range(6)]


def test_json_array_bad_elements(tmp_path):
    """Bytes that are not UTF-8 spoil one element; an array cut inside an element is a damaged file, raised
    after the rows before it."""
    from dflash_train.data.formats import DamagedDataFile

    f = tmp_path / "b.json"
    good = json.dumps(openai("q", "a")).encode()
    f.write_bytes(b"[" + good + b", " + b'{"prompt": "\xff"}' + b", " + good + b", {broken")
    got = []
    with pytest.raises(DamagedDataFile, match=r"ends inside element #3") as e:
        for w, r in iter_rows(f):
            got.append((w, r.reason if isinstance(r, RowError) else "ok"))
    assert got == [(f"{f}:#0", "ok"), (f"{f}:#1", "not UTF-8"), (f"{f}:#2", "ok")] and e.value.rows_read == 3


def test_corrupt_parquet_stops_prepare_unless_skipped(tok, tmp_path):
    from dflash_train.data.formats import DamagedDataFile

    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"PAR1 this is not parquet")
    good = tmp_path / "good.jsonl"
    good.write_text(json.dumps(openai("q", words(40))) + "\n")
    out = tmp_path / "P"
    with pytest.raises(DamagedDataFile, match="not a readable Parquet file"):
        prepare(tok, "t", [str(bad), str(good)], out, PrepareConfig(block_size=4, val_fraction=0.0))
    assert not out.exists()
    m = prepare(tok, "t", [str(bad), str(good)], out,
                PrepareConfig(block_size=4, val_fraction=0.0, skip_damaged_files=True))
    assert m["counts"]["kept"] == 1 and m["counts"]["rejected"] == {}
    assert [d["path"] for d in m["counts"]["damaged_files"]] == [str(bad)]


# ------------------------------------------------------------------------ determinism, splits, atomic


def test_same_input_and_config_give_a_byte_identical_directory(tok, tmp_path):
    src = tmp_path / "d.jsonl"
    rows = [openai(f"Q{i}?", words(30 + i % 7, i)) for i in range(300)]
    src.write_text("".join(json.dumps(r) + "\n" for r in rows) + "{bad json\n")
    cfg = PrepareConfig(max_length=256, block_size=4, val_fraction=0.2, shard_rows=64)
    m1 = prepare(tok, "t", [str(src)], tmp_path / "A", cfg)
    m2 = prepare(tok, "t", [str(src)], tmp_path / "B", cfg)
    a, b = all_files(tmp_path / "A"), all_files(tmp_path / "B")
    assert a == b and m1 == m2
    assert len([k for k in a if k.startswith("train/")]) == 4 and any(k.startswith("val/") for k in a)
    # manifest: fingerprints, config, counts, sources with checksums
    assert m1["tokenizer_fingerprint"] == tokenizer_fingerprint(tok)
    assert m1["chat_template_fingerprint"] == chat_template_fingerprint(tok)
    assert m1["format_version"] == 1 and m1["max_length"] == 256 and m1["block_size"] == 4 and m1["thinking"] is None
    f = m1["sources"][0]["files"][0]
    assert f["size"] == src.stat().st_size and f["sha256"].startswith("sha256:")
    s = m1["splits"]
    assert s["train"]["rows"] + s["val"]["rows"] == 300 and 30 < s["val"]["rows"] < 90
    assert s["train"]["tokens"] == int(PreparedDataset(tmp_path / "A", "train").lengths.sum())


def test_validation_split_follows_the_content_not_the_position(tok, tmp_path):
    rows = [openai(f"Q{i}?", words(30, i)) for i in range(200)]
    sharegpt = [{"conversations": [{"from": "human", "value": r["messages"][0]["content"]},
                                   {"from": "gpt", "value": r["messages"][1]["content"]}]} for r in rows]
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text("".join(json.dumps(r) + "\n" for r in rows))
    b.write_text("".join(json.dumps(r) + "\n" for r in reversed(sharegpt)))  # other order, other shape
    cfg = PrepareConfig(max_length=256, block_size=4, val_fraction=0.25)
    val = []
    for f in (a, b):
        prepare(tok, "t", [str(f)], tmp_path / f"P{f.stem}", cfg)
        ds = PreparedDataset(tmp_path / f"P{f.stem}", "val")
        val.append(sorted(tuple(ds.example(i).input_ids.tolist()) for i in range(len(ds))))
    assert val[0] == val[1] and 20 < len(val[0]) < 80
    assert sum(holdout_key(to_messages(r)) < 0.25 for r in rows) == len(val[0])


def test_thinking_flag_reaches_templates_that_read_it(tok, tmp_path):
    from dflash_train.commands.prepare import template_kwargs_for

    assert template_kwargs_for(tok, True) == {}  # SmolLM2's template has no thinking switch
    tok2 = load_tokenizer(tok.name_or_path)
    think = "{% if enable_thinking is defined and not enable_thinking %}{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}"
    tok2.chat_template = (
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' }}{% if m['role'] == 'assistant' %}" + think
        + "{% endif %}{{ m['content'] + '<|im_end|>\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}" + think + "{% endif %}"
    )
    assert template_kwargs_for(tok2, False) == {"enable_thinking": False}
    src = tmp_path / "t.jsonl"
    src.write_text(json.dumps(openai("q", words(40))) + "\n")
    for flag in (None, False):
        m = prepare(tok2, "t", [str(src)], tmp_path / f"P{flag}", PrepareConfig(block_size=4, val_fraction=0.0, thinking=flag))
        assert m["thinking"] == flag
    off = tok2.decode(PreparedDataset(tmp_path / "PFalse").example(0).input_ids)
    assert tok2.decode(PreparedDataset(tmp_path / "PNone").example(0).input_ids) != off


def test_a_killed_prepare_leaves_no_complete_looking_directory(tiny_target_dir, tmp_path):
    src = tmp_path / "k.jsonl"
    with open(src, "w") as f:
        for i in range(30000):
            f.write(json.dumps(openai(f"Q{i}?", words(30, i))) + "\n")
    out = tmp_path / "P"
    cmd = [sys.executable, "-m", "dflash_train", "prepare", "--target", str(tiny_target_dir), "--data", str(src),
           "--out", str(out), "--block-size", "4", "--shard-rows", "1000"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 60
        while time.time() < deadline and not list(tmp_path.glob(".P.prepare-*/train/shard-00001.arrow")):
            time.sleep(0.1)
        assert proc.poll() is None, "prepare finished before it could be killed"
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait()
    assert not out.exists() and list(tmp_path.glob(".P.prepare-*"))
    small = tmp_path / "s.jsonl"
    small.write_text(json.dumps(openai("q", words(40))) + "\n")
    assert main(["prepare", "--target", str(tiny_target_dir), "--data", str(small), "--out", str(out), "--block-size", "4"]) == 0
    assert (out / "manifest.json").is_file() and not list(tmp_path.glob(".P.prepare-*"))  # the dead temp dir is gone


# ------------------------------------------------------------------------------------ bounded memory


def _rss(key: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM (peak RSS) to the current RSS
        return True
    except OSError:
        return False


def _synthetic(path: Path, n: int) -> int:
    rng = random.Random(n)
    vocab = ["alpha", "beta", "gamma", "delta", "omega", "sigma", "kappa", "theta", "lambda", "zeta"]
    with open(path, "w") as f:
        for i in range(n):
            q = " ".join(rng.choice(vocab) for _ in range(12))
            a = " ".join(rng.choice(vocab) for _ in range(24))
            # extra fields, as real exports have: bytes to read, nothing to tokenise
            f.write(json.dumps({"id": f"row-{i:08d}", "meta": {"source": "synthetic", "notes": "x" * 700},
                                "messages": [{"role": "user", "content": f"{i}: {q}"},
                                             {"role": "assistant", "content": a}]}) + "\n")
    return path.stat().st_size


@pytest.mark.slow
@pytest.mark.long
def test_memory_stays_bounded_on_a_large_input(tok, tmp_path):
    if not _reset_peak_rss():
        pytest.skip("needs /proc/self/clear_refs (Linux) to measure peak RSS")
    small, big = tmp_path / "small.jsonl", tmp_path / "big.jsonl"
    small_size, big_size = _synthetic(small, 4000), _synthetic(big, 40000)
    cfg = PrepareConfig(max_length=256, block_size=4, val_fraction=0.01, shard_rows=10000)
    prepare(tok, "t", [str(small)], tmp_path / "warm", cfg)  # one-time costs: template compile, pools, caches

    def growth(src: Path, out: Path) -> tuple[int, dict]:
        _reset_peak_rss()
        before = _rss("VmRSS")
        m = prepare(tok, "t", [str(src)], out, cfg)
        return _rss("VmHWM") - before, m

    g_small, _ = growth(small, tmp_path / "S")
    g_big, m = growth(big, tmp_path / "B")
    stored = sum(m["splits"][s]["tokens"] for s in ("train", "val")) * 5  # int32 ids + uint8 mask
    assert m["counts"]["kept"] == 40000 and big_size > 30e6
    # 10x the rows costs no more memory than 1x (plus noise), far below the input and the tokenised data
    assert g_big < g_small + 0.05 * big_size, (g_small, g_big)
    assert g_big < big_size / 4 and g_big < stored / 2, (g_big, big_size, stored)

    # Reading: lengths in memory, tokens stay in the mapped files until an example is asked for
    _reset_peak_rss()
    before = _rss("VmRSS")
    ds = PreparedDataset(tmp_path / "B", "train")
    assert len(ds) == m["splits"]["train"]["rows"] and len(ds._chunks) > 4
    assert _rss("VmHWM") - before < stored / 4
    i = len(ds) - 1
    assert tok.decode(ds.example(i).input_ids).count("<|im_start|>") == 3
