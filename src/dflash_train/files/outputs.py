"""Where a command may write its output, and what `--overwrite` may replace there.

Each command's output is recognised by the files that command writes (outputs of earlier versions count too):
- export: a folder holding model.safetensors and a config.json whose `architectures` names a DFlash drafter
  (the reference format `save_drafter` writes);
- prepare: a folder whose manifest.json says `"format": "dflash-train/prepared"` (data/store.py);
- eval: a JSON object with `config`, `datasets` and `outputs` (infer/evaluate.py write_report), and the
  Markdown table beside it, which starts with evaluate.REPORT_TITLE;
- regen: OUT with OUT.regen.json (its settings record) beside it, which the same command continues (regen is
  resumable, it never starts OUT over); the --export-batch file: OpenAI batch requests, one JSON object with
  custom_id, method, url and body per line, rewritten each round.

The rules, checked before any model or tokenizer loads:
- a missing path, an empty folder (or, for eval and regen, an empty file) is always fine; anything else is
  refused without --overwrite;
- --overwrite replaces only an output of the same kind: a folder is moved aside to NAME.old-<time> beside it
  (never deleted; the log says where), a file is replaced;
- refused whatever the flags: an output that is, holds or lies inside an input of the same command; and, for
  export, any part of a training run (the run, its checkpoints/, a checkpoint, its export/, which `train`
  writes) or a live run's directory, named as such.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable, Iterable, Optional

from ..errors import UserError
from ..run.directory import RunDir
from .io import replace_dir
from .layout import STATE

Input = tuple[str, Path]  # (the flag that gave it, the path)

_SHOWN = 4  # entries of a folder named in a message


class OutputRefused(UserError):
    """An output path this command may not write (or may not replace without --overwrite)."""


def holds_something(path: Path) -> bool:
    if path.is_dir():
        return any(path.iterdir())
    return path.exists() and path.stat().st_size > 0


def put_in_place(tmp: Path, final: Path, overwrite: bool) -> Optional[Path]:
    """Rename the finished folder `tmp` to `final` (export's and prepare's output). A non-empty `final` (admitted
    earlier by the checks below) is moved aside to FINAL.old-<time>, never deleted; returns where it went, or None."""
    full = holds_something(final)
    if full and not overwrite:  # it appeared while this command was working
        raise OutputRefused(f"{final} already exists; pass --overwrite to replace it or choose another --out")
    return replace_dir(tmp, final, keep_old=full)


# ------------------------------------------------------------------------------------------ output kinds


def is_export(path: Path) -> bool:
    """A DFlash drafter in the reference format: model.safetensors and a DFlash config.json."""
    from ..architectures import UnknownArchitecture, architecture_of_export  # here: it imports torch

    if not (path / "model.safetensors").is_file() or (path / STATE).exists():
        return False
    try:
        architecture_of_export(json.loads((path / "config.json").read_text()))
    except (OSError, ValueError, AttributeError, UnknownArchitecture):
        return False
    return True


def is_prepared_dataset(path: Path) -> bool:
    from ..data.store import FORMAT, MANIFEST

    return _json_object(path / MANIFEST).get("format") == FORMAT


def is_eval_report(path: Path) -> bool:
    report = _json_object(path)
    return (isinstance(report.get("config"), dict) and isinstance(report.get("datasets"), dict)
            and isinstance(report.get("outputs"), list))


def is_eval_table(path: Path) -> bool:
    from ..infer.evaluate import REPORT_TITLE

    return _starts_with(path, REPORT_TITLE.encode())


def is_batch_requests(path: Path) -> bool:
    """The first line is an OpenAI batch request (what `regen --export-batch` writes)."""
    try:
        with open(path, "rb") as f:
            first = json.loads(f.readline())
    except (OSError, ValueError):
        return False
    return isinstance(first, dict) and {"custom_id", "method", "url", "body"} <= first.keys()


def is_regen_record(path: Path) -> bool:
    """The settings record regen keeps beside its output (OUT.regen.json)."""
    record = _json_object(path)
    return "mode" in record and isinstance(record.get("settings"), dict)


# ------------------------------------------------------------------------------------------ per command


def check_export_out(out: Path, checkpoint: Path, overwrite: bool) -> None:
    out = Path(out)
    found = _run_around(out)
    if found is not None:
        from ..train.start.directory_admission import live_owner  # here: it imports torch

        folder, kind = found
        owner = live_owner(RunDir(folder))
        if owner:
            raise OutputRefused(f"--out {out}: {owner}")
        where = f"is a {kind}" if folder == _resolved(out) else f"lies inside the {kind} {folder}"
        raise OutputRefused(f"--out {out} {where}: export never writes into a training run or a checkpoint "
                            "(checkpoints are finished work, a run's export/ folder is train's); choose an --out "
                            "outside it")
    _refuse_overlap(out, "--out", [("the checkpoint", Path(checkpoint))])
    _check_existing_folder(out, is_export, "an exported drafter", "export", overwrite)


def check_prepare_out(out: Path, data: Iterable[str], overwrite: bool) -> None:
    out = Path(out)
    _refuse_overlap(out, "--out", _inputs("--data", data))
    _check_existing_folder(out, is_prepared_dataset, "a prepared dataset", "prepare", overwrite)


def check_report_out(out: Path, inputs: Iterable[Input], overwrite: bool) -> None:
    """eval's --out: the JSON report and the Markdown table beside it; its folder must be writable."""
    out = Path(out)
    if out.suffix == ".md":
        raise OutputRefused(f"--out {out}: the report's Markdown table is written beside it as {out.name}, so "
                            "--out cannot end in .md; give the JSON report's name, e.g. eval.json")
    _refuse_overlap(out, "--out", inputs)
    for path, recognise in ((out, is_eval_report), (out.with_suffix(".md"), is_eval_table)):
        if path.is_dir():
            raise OutputRefused(f"--out {out}: {path} is a folder; --out is the report's JSON file "
                                f"(e.g. {out / 'eval.json'})")
        if not holds_something(path):
            continue
        if not recognise(path):
            raise OutputRefused(f"--out {out}: {path} exists and is not an eval report (eval writes {out.name} and "
                                f"{out.with_suffix('.md').name}); choose another --out")
        if not overwrite:
            raise OutputRefused(f"{path} already exists (an eval report); pass --overwrite to replace it or choose "
                                "another --out")
    _check_writable(out)


def check_regen_outputs(out: Optional[Path], export_batch: Optional[Path], data: Iterable[str],
                        imports: Iterable[str]) -> None:
    """regen continues its own output (the same command resumes it); it never writes onto an input, a
    folder or a file it did not write."""
    from ..data.regen.journal import side_paths

    inputs = _inputs("--data", data) + _inputs("--import-batch", imports)
    if out is not None:
        out = Path(out)
        _refuse_folder(out, "--out", "regen.jsonl")
        _refuse_overlap(out, "--out", inputs)
        sidecar = side_paths(out)[0]
        if holds_something(sidecar) and not is_regen_record(sidecar):
            raise OutputRefused(f"--out {out}: {sidecar} exists and is not the settings record regen keeps beside "
                                "its output; choose another --out")
        if holds_something(out) and not sidecar.is_file():
            raise OutputRefused(f"--out {out} exists and is not a regen output ({sidecar.name}, which regen writes "
                                "beside it, is not there); regen only continues its own output: choose another --out")
    if export_batch is not None:
        export_batch = Path(export_batch)
        _refuse_folder(export_batch, "--export-batch", "requests.jsonl")
        _refuse_overlap(export_batch, "--export-batch", inputs + ([("--out", out)] if out is not None else []))
        if holds_something(export_batch) and not is_batch_requests(export_batch):
            raise OutputRefused(f"--export-batch {export_batch} exists and is not a batch request file (regen "
                                "writes one request per line: custom_id, method, url, body); choose another "
                                "--export-batch")


# ------------------------------------------------------------------------------------------ helpers


def _resolved(path: Path) -> Path:
    return Path(path).expanduser().resolve()


def _inputs(flag: str, specs: Iterable[str]) -> list[Input]:
    return [(flag, Path(s)) for s in specs]


def _refuse_overlap(out: Path, flag: str, inputs: Iterable[Input]) -> None:
    o = _resolved(out)
    for input_flag, path in inputs:
        if not Path(path).expanduser().exists():  # a built-in name (smollm2, mt-bench), or missing: said later
            continue
        i = _resolved(path)
        how = "is" if o == i else "lies inside" if o.is_relative_to(i) else "holds" if i.is_relative_to(o) else None
        if how:
            raise OutputRefused(f"{flag} {out} {how} {input_flag} {path}, which this command reads: choose "
                                f"{flag} outside its inputs")


def _is_run(folder: Path) -> bool:
    """A training run: status.json, or config.yaml and checkpoints/. Stricter than paths.is_run: a project
    folder with a config.yaml of its own is not a run."""
    run = RunDir(folder)
    return run.status.is_file() or (run.config.is_file() and run.checkpoints.is_dir())


def _run_around(out: Path) -> Optional[tuple[Path, str]]:
    """(the folder, "training run" or "checkpoint") that `out` is or lies inside, if any: the run, else a
    checkpoint kept outside a run."""
    here = _resolved(out)
    folders = (here, *here.parents)
    for kind, found in (("training run", _is_run), ("checkpoint", lambda f: (f / STATE).is_file())):
        for folder in folders:
            if folder.is_dir() and found(folder):
                return folder, kind
    return None


def _describe(folder: Path) -> str:
    names = sorted(p.name + "/" * p.is_dir() for p in folder.iterdir())
    more = f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else ""
    return f"it holds {', '.join(names[:_SHOWN])}{more}"


def _check_existing_folder(out: Path, recognise: Callable[[Path], bool], kind: str, command: str,
                           overwrite: bool) -> None:
    if not out.exists():
        return
    if not out.is_dir():
        raise OutputRefused(f"--out {out} is a file, not {kind}: {command} writes a folder there; choose another "
                            "--out (a new or empty folder)")
    if not any(out.iterdir()):
        return
    if not recognise(out):
        raise OutputRefused(f"--out {out} is not {kind} ({_describe(out)}): {command} writes into a new or empty "
                            f"folder, and --overwrite replaces only {kind} made by {command}; choose another --out")
    if not overwrite:
        raise OutputRefused(f"{out} already exists ({kind}); pass --overwrite to replace it (the old one is moved "
                            f"aside to {out.name}.old-<time>, not deleted) or choose another --out")


def _refuse_folder(path: Path, flag: str, example: str) -> None:
    if path.is_dir():
        raise OutputRefused(f"{flag} {path} is a folder; {flag} names the JSONL file to write, e.g. {path / example}")


def _check_writable(out: Path) -> None:
    """The nearest existing folder above `out` must be a folder this process can write into."""
    for folder in _resolved(out).parents:
        if not folder.exists():
            continue
        if not folder.is_dir():
            raise OutputRefused(f"--out {out}: {folder} is a file, so nothing can be written inside it; choose "
                                "another --out")
        if not os.access(folder, os.W_OK | os.X_OK):
            raise OutputRefused(f"--out {out}: {folder} is not writable by this user; choose another --out")
        return


def _json_object(path: Path) -> dict:
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _starts_with(path: Path, prefix: bytes) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(len(prefix)) == prefix
    except OSError:
        return False
