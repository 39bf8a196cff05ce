"""What a command may write over (files/outputs.py): `--overwrite` replaces only that command's own earlier output
(a folder is moved aside, never deleted); anything else (unrelated files, the command's inputs, a run, a live
run) is refused in one line, before anything loads, and left byte-identical. And what the tool writes for
others to read follows the umask."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import stat
import time
from pathlib import Path

import pytest

from conftest import tiny_drafter
from dflash_train.cli import main

# ------------------------------------------------------------------------------------------ helpers


def tree(root: Path) -> dict[str, str]:
    """Every name under `root` and the hash of every file: equal before and after means untouched."""
    return {str(p.relative_to(root)): "dir" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*"))}


def refused(capsys, argv: list[str], root: Path, *needles: str) -> str:
    """Run `argv`: exit 2, one `error:` line holding every needle, no traceback, `root` untouched."""
    before = tree(root)
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, err
    for needle in needles:
        assert needle in lines[0], lines[0]
    assert tree(root) == before
    return lines[0]




def write_checkpoint(root: Path, step: int) -> Path:
    import torch

    from dflash_train.train.checkpoint import save_checkpoint

    drafter = tiny_drafter(seed=step)
    opt = torch.optim.AdamW(drafter.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    return save_checkpoint(root, step, drafter, opt, sched, {"epoch": 0, "batch_index": step}, keep_last=5)


@pytest.fixture
def run(tmp_path) -> Path:
    """A finished run: config, status, metrics, two checkpoints (different weights) and export/."""
    from dflash_train.architectures.io import save_drafter
    from dflash_train.run.directory import RunDir

    r = RunDir(tmp_path / "run").create()
    r.config.write_text("target:\n  path: smollm2\n")
    r.status.write_text(json.dumps({"phase": "done", "step": 20}))
    r.metrics.write_text('{"step": 10, "loss": 1.0}\n')
    for step in (10, 20):
        write_checkpoint(r.checkpoints, step)
    save_drafter(tiny_drafter(seed=20), r.export, dtype="float32")
    return r.root


def export_argv(run: Path, step: int, out: Path, *extra: str) -> list[str]:
    return ["export", str(run / "checkpoints" / f"step-{step:08d}"), "--out", str(out), "--dtype", "float32", *extra]


def live_status() -> dict:
    from dflash_train.run import procs

    return {"phase": "training", "step": 3, "heartbeat": time.time(), "pid": os.getpid(),
            "pid_start": procs.start_ticks(os.getpid()), "host": socket.gethostname()}


# ------------------------------------------------------------------------------------------ export


def test_export_refuses_a_folder_of_other_files(run, tmp_path, capsys):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("my notes")
    (out / "data.bin").write_bytes(b"\0" * 100)
    for flags in ((), ("--overwrite",)):
        refused(capsys, export_argv(run, 10, out, *flags), tmp_path, f"--out {out} is not an exported drafter",
                "data.bin, notes.txt", "choose another --out")
    (tmp_path / "file").write_text("x")
    refused(capsys, export_argv(run, 10, tmp_path / "file", "--overwrite"), tmp_path, "is a file")


@pytest.mark.parametrize("part", ["", "checkpoints", "checkpoints/step-00000010", "checkpoints/step-00000020/drafter",
                                  "export", "new-folder", "checkpoints/new-folder"])
def test_export_never_writes_into_a_run(run, tmp_path, capsys, part):
    out = run / part if part else run
    where = "is a training run" if not part else f"lies inside the training run {run}"
    refused(capsys, export_argv(run, 10, out, "--overwrite"), tmp_path, f"--out {out}", where,
            "choose an --out outside it")


def test_export_refuses_a_live_run(tmp_path, capsys):
    from dflash_train.run.directory import RunDir

    ckpt = write_checkpoint(tmp_path / "ckpts", 10)
    live = RunDir(tmp_path / "live").create()
    live.config.write_text("target:\n  path: smollm2\n")
    live.status.write_text(json.dumps(live_status()))
    write_checkpoint(live.checkpoints, 5)
    refused(capsys, ["export", str(ckpt), "--out", str(live.root), "--overwrite"], tmp_path,
            f"{live.root} is in use: pid {os.getpid()}", f"dflash-train stop {live.root}")


def test_export_refuses_a_folder_holding_the_checkpoint(run, tmp_path, capsys):
    ckpt = write_checkpoint(tmp_path / "loose", 10)  # a checkpoint outside any run
    refused(capsys, ["export", str(ckpt), "--out", str(tmp_path / "loose"), "--overwrite"], tmp_path,
            f"--out {tmp_path / 'loose'} holds the checkpoint {ckpt}")
    refused(capsys, ["export", str(ckpt), "--out", str(ckpt / "x"), "--overwrite"], tmp_path,
            f"--out {ckpt / 'x'} lies inside the checkpoint {ckpt}", "export never writes into")


def test_overwrite_moves_an_earlier_export_aside(run, tmp_path, capsys, caplog):
    from dflash_train.files.outputs import is_export

    out = tmp_path / "exported"
    assert main(export_argv(run, 10, out)) == 0
    first = tree(out)
    refused(capsys, export_argv(run, 20, out), tmp_path, f"{out} already exists (an exported drafter)", "--overwrite")
    with caplog.at_level(logging.WARNING, logger="dflash_train"):
        assert main(export_argv(run, 20, out, "--overwrite")) == 0
    (aside,) = tmp_path.glob("exported.old-*")
    assert f"aside to {aside}" in caplog.text
    assert tree(aside) == first  # the earlier export, whole
    assert tree(out) != first and is_export(out)
    assert "step-00000020" in (out / "README.md").read_text()
    assert not list(tmp_path.glob(".exported*"))  # no staging folder left


# ------------------------------------------------------------------------------------------ prepare


def test_prepare_never_writes_over_its_input(tmp_path, capsys):
    raw = tmp_path / "raw"
    raw.mkdir()
    conv = raw / "conv.jsonl"
    conv.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                             {"role": "assistant", "content": "hello"}]}) + "\n")
    no_target = str(tmp_path / "no-target")  # refused before the target's tokenizer is looked for
    refused(capsys, ["prepare", "--target", no_target, "--data", str(conv), "--out", str(raw), "--overwrite"],
            tmp_path, f"--out {raw} holds --data {conv}, which this command reads")
    refused(capsys, ["prepare", "--target", no_target, "--data", str(raw), "--out", str(raw / "prepared")],
            tmp_path, f"--out {raw / 'prepared'} lies inside --data {raw}")
    refused(capsys, ["prepare", "--target", no_target, "--data", str(conv), "--out", str(conv), "--overwrite"],
            tmp_path, f"--out {conv} is --data {conv}")


def test_prepare_refuses_a_folder_of_other_files(tmp_path, capsys, counting_jsonl):
    other = tmp_path / "other"
    other.mkdir()
    (other / "keep.txt").write_text("keep me")
    for flags in ((), ("--overwrite",)):
        refused(capsys, ["prepare", "--target", str(tmp_path / "no-target"), "--data", str(counting_jsonl),
                         "--out", str(other), *flags], tmp_path, f"--out {other} is not a prepared dataset",
                "keep.txt")


def test_prepare_overwrite_moves_the_earlier_dataset_aside(tmp_path, capsys, caplog, counting_jsonl, tiny_target_dir):
    out = tmp_path / "prepared"
    argv = ["prepare", "--target", str(tiny_target_dir), "--data", str(counting_jsonl), "--out", str(out),
            "--block-size", "4", "--max-length", "256"]
    assert main(argv) == 0
    first = tree(out)
    refused(capsys, argv, tmp_path, f"{out} already exists (a prepared dataset)", "--overwrite")
    with caplog.at_level(logging.WARNING, logger="dflash_train"):
        assert main([*argv, "--val-fraction", "0.5", "--overwrite"]) == 0
    (aside,) = tmp_path.glob("prepared.old-*")
    assert f"aside to {aside}" in caplog.text
    assert tree(aside) == first
    assert json.loads((out / "manifest.json").read_text())["val_fraction"] == 0.5


# ------------------------------------------------------------------------------------------ eval


@pytest.fixture
def drafter_dir(tmp_path) -> Path:
    from dflash_train.architectures.io import save_drafter

    return save_drafter(tiny_drafter(seed=1), tmp_path / "drafter", dtype="float32")


def eval_argv(target, drafter: Path, out: Path, *extra: str, data: str = "mt-bench") -> list[str]:
    return ["eval", "--target", str(target), "--drafter", str(drafter), "--data", data, "--out", str(out), *extra]


def test_eval_refuses_a_report_path_it_did_not_write(tmp_path, drafter_dir, capsys):
    no_target = tmp_path / "no-target"  # refused before any model loads
    notes = tmp_path / "notes.json"
    notes.write_text('{"mine": 1}')
    for flags in ((), ("--overwrite",)):
        refused(capsys, eval_argv(no_target, drafter_dir, notes, *flags), tmp_path,
                f"{notes} exists and is not an eval report")
    (tmp_path / "r.md").write_text("# my notes\n")  # the table's place beside r.json
    refused(capsys, eval_argv(no_target, drafter_dir, tmp_path / "r.json", "--overwrite"), tmp_path,
            f"{tmp_path / 'r.md'} exists and is not an eval report")
    refused(capsys, eval_argv(no_target, drafter_dir, drafter_dir / "eval.json"), tmp_path,
            f"--out {drafter_dir / 'eval.json'} lies inside --drafter {drafter_dir}")
    (tmp_path / "folder").mkdir()
    refused(capsys, eval_argv(no_target, drafter_dir, tmp_path / "folder"), tmp_path, "is a folder")
    refused(capsys, eval_argv(no_target, drafter_dir, tmp_path / "e.md"), tmp_path, "cannot end in .md")
    refused(capsys, eval_argv(no_target, drafter_dir, notes / "sub" / "e.json"), tmp_path,
            f"{notes} is a file, so nothing can be written inside it")


def test_eval_replaces_its_own_report_only_with_overwrite(tmp_path, capsys, tiny_target_dir):
    from transformers import AutoConfig

    from dflash_train.architectures.family.config import make_drafter_config
    from dflash_train.architectures.dflash.model import DFlashDrafter
    from dflash_train.architectures.io import save_drafter

    cfg = make_drafter_config(AutoConfig.from_pretrained(tiny_target_dir), num_draft_layers=1, block_size=4,
                              target_layer_ids=[1, 4], mask_token_id=16)
    drafter = save_drafter(DFlashDrafter(cfg), tmp_path / "drafter", dtype="float32")
    data = tmp_path / "prompts.jsonl"
    data.write_text(json.dumps({"id": "p", "prompt": "Say something about rivers."}) + "\n")
    out = tmp_path / "reports" / "e.json"
    argv = eval_argv(tiny_target_dir, drafter, out, "--max-new-tokens", "4", "--device", "cpu", "--no-baseline",
                     data=str(data))
    assert main(argv) == 0
    refused(capsys, argv, tmp_path, f"{out} already exists (an eval report)", "--overwrite")
    out.write_text(out.read_text().replace('"datasets"', '"was_datasets"'))  # no longer the shape of a report
    refused(capsys, [*argv, "--overwrite"], tmp_path, f"{out} exists and is not an eval report")
    out.write_text(out.read_text().replace('"was_datasets"', '"datasets"'))
    out.with_suffix(".md").write_text(out.with_suffix(".md").read_text() + "stale\n")
    assert main([*argv, "--overwrite"]) == 0
    assert "stale" not in out.with_suffix(".md").read_text()


# ------------------------------------------------------------------------------------------ regen


def test_regen_never_writes_over_an_input_or_a_file_it_did_not_write(tmp_path, capsys):
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "hi"}\n')
    other = tmp_path / "other.jsonl"
    other.write_text('{"something": "else"}\n')
    no_target = str(tmp_path / "no-target")  # refused before the target is looked for
    regen = ["regen", "--target", no_target, "--data", str(data)]
    refused(capsys, [*regen, "--out", str(data)], tmp_path, f"--out {data} is --data {data}")
    refused(capsys, [*regen, "--out", str(other)], tmp_path, f"--out {other} exists and is not a regen output",
            "other.jsonl.regen.json")
    refused(capsys, [*regen, "--out", str(tmp_path)], tmp_path, f"--out {tmp_path} is a folder")
    batch = ["regen", "--data", str(data), "--model", "m", "--export-batch"]
    refused(capsys, [*batch, str(other)], tmp_path, f"--export-batch {other} exists and is not a batch request file")
    refused(capsys, [*batch, str(data)], tmp_path, f"--export-batch {data} is --data {data}")


def test_regen_rewrites_its_own_batch_file(tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "hi"}\n{"prompt": "hello"}\n')
    batch = tmp_path / "batch.jsonl"
    argv = ["regen", "--data", str(data), "--model", "m", "--export-batch", str(batch)]
    assert main(argv) == 0
    assert main([*argv, "--max-new-tokens", "7"]) == 0  # the next round rewrites it
    assert json.loads(batch.read_text().splitlines()[0])["body"]["max_tokens"] == 7


# ------------------------------------------------------------------------------------------ permissions


def modes(root: Path) -> set[tuple[str, str]]:
    return {("dir" if p.is_dir() else "file", oct(stat.S_IMODE(p.stat().st_mode))) for p in [root, *root.rglob("*")]}


@pytest.mark.parametrize("umask,dirs,files", [(0o022, "0o755", "0o644"), (0o027, "0o750", "0o640")])
def test_exports_checkpoints_and_prepared_data_follow_the_umask(tmp_path, counting_jsonl, tiny_target_dir,
                                                                umask, dirs, files):
    old = os.umask(umask)
    try:
        ckpt = write_checkpoint(tmp_path / "run" / "checkpoints", 10)
        assert main(["export", str(ckpt), "--out", str(tmp_path / "exported"), "--dtype", "float32"]) == 0
        assert main(["prepare", "--target", str(tiny_target_dir), "--data", str(counting_jsonl), "--out",
                     str(tmp_path / "prepared"), "--block-size", "4", "--max-length", "256"]) == 0
    finally:
        os.umask(old)
    assert modes(ckpt / "drafter") == {("dir", dirs), ("file", files)}
    assert modes(tmp_path / "exported") == {("dir", dirs), ("file", files)}
    assert modes(tmp_path / "prepared") == {("dir", dirs), ("file", files)}


def test_the_converted_target_cache_follows_the_umask(tmp_path, monkeypatch):
    """The cache's own steps (temp folder, modes, publishing) around a stand-in for the dequantisation (the real
    conversion, ~25 s: tests/unit/foundations/test_assets.py), which leaves owner-only modes that the cache must widen."""
    from dflash_train import assets

    def convert(gguf, out):
        (out / "tokenizer").mkdir(mode=0o700)
        for name in ("config.json", assets.TARGET_META, "tokenizer/tokenizer.json"):
            os.close(os.open(out / name, os.O_CREAT | os.O_WRONLY, 0o600))

    monkeypatch.setattr(assets, "convert_gguf", convert)
    old = os.umask(0o027)
    try:
        path = assets.resolve_target("smollm2", cache_dir=tmp_path)
    finally:
        os.umask(old)
    assert assets.is_converted_target(path) and path.parent == tmp_path / "targets"
    assert modes(path) == {("dir", "0o750"), ("file", "0o640")}
