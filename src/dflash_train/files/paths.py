"""What a folder given on the command line is (a run, a training checkpoint, an exported drafter), and the one-line
errors that say which command takes it instead. The file names, and whether a folder is a complete model folder,
are files/layout.py's."""

from __future__ import annotations

import json
from pathlib import Path

from ..architectures import registry
from ..run.directory import RunDir
from .layout import (DRAFTER_FILES, STATE, InputPathError, has_drafter_files, is_checkpoint, is_exported_drafter,
                     list_checkpoints, step_of)


def has_training_layout(path: Path) -> bool:
    """A drafter folder whose weights are a training-time layout the export turns into the reference one (its
    architecture's `Options.training_layout` says, from the config.json alone)."""
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(config, dict):
        return False
    try:
        entry = registry.entry_of_export(config)
    except registry.NotAnExport:
        return False
    check = registry.options(entry.name).training_layout
    return bool(check and check(config))


def is_run(path: Path) -> bool:
    run = RunDir(path)
    return run.status.is_file() or run.config.is_file() or run.checkpoints.is_dir()


def checkpoints_of(folder: Path) -> list[Path]:
    """The complete checkpoints in `folder` (a run's checkpoints/): step-N newest first, then `best`."""
    return list(reversed(list_checkpoints(folder))) + [folder / "best"] * is_checkpoint(folder / "best")


def _newest(folder: Path, few: int = 3) -> str:
    """`checkpoints in FOLDER: step-00000030, step-00000020, step-00000010 (+2 older), best`."""
    found = checkpoints_of(folder)
    steps = [p.name for p in found if p.name != "best"]
    if not found:
        return f"{folder} holds no complete checkpoint yet"
    names = steps[:few] + [f"(+{len(steps) - few} older)"] * (len(steps) > few) + ["best"] * (len(steps) < len(found))
    return f"checkpoints in {folder}: {', '.join(names)}"


def _step_shorthand(path: Path) -> Path | None:
    """`step-20` -> the existing `step-00000020` beside it (or in RUN/checkpoints/ for RUN/step-20);
    `RUN/best` -> RUN/checkpoints/best."""
    folders = [path.parent] + ([RunDir(path.parent).checkpoints] if is_run(path.parent) else [])
    step = step_of(path.name)
    for folder in folders:
        if step is not None:
            hits = [p for p in list_checkpoints(folder) if step_of(p.name) == step]
            if hits:
                return hits[0]
        elif path.name == "best" and is_checkpoint(folder / "best"):
            return folder / "best"
    return None


def _missing(path: Path, names: tuple[str, ...]) -> str:
    return ", ".join(n for n in names if not (path / n).exists())


def resolve_checkpoint(path: Path) -> Path:
    """The training checkpoint folder `export` reads: RUN/checkpoints/step-N (zero-padded or not), `best`,
    or a checkpoint's drafter/ folder. Anything else raises InputPathError saying what it is and what fits."""
    path = Path(path)
    if is_checkpoint(path):
        return path
    if path.name == "drafter" and is_checkpoint(path.parent) and has_drafter_files(path):
        return path.parent
    if not path.exists():
        found = _step_shorthand(path)
        if found is not None:
            return found
        folder = RunDir(path.parent).checkpoints if is_run(path.parent) else path.parent
        near = f"; {_newest(folder)}" if folder.is_dir() and (is_run(path.parent) or checkpoints_of(folder)) else ""
        raise InputPathError(f"{path} does not exist{near}")
    usage = "export takes a training checkpoint: dflash-train export RUN/checkpoints/step-N --out DIR"
    if is_run(path) or checkpoints_of(path):
        folder, what = (RunDir(path).checkpoints, "a training run") if is_run(path) else (path, "a folder of checkpoints")
        found = checkpoints_of(folder)
        todo = (f"export one of its checkpoints, e.g. dflash-train export {found[0]} --out DIR ({_newest(folder)})"
                if found else _newest(folder))
        export = RunDir(folder.parent).export
        done = f"; its exported drafter is already in {export}" if is_exported_drafter(export) else ""
        raise InputPathError(f"{path} is {what}, not a checkpoint: {todo}{done}")
    if is_exported_drafter(path) and has_training_layout(path):
        return path  # a checkpoint's drafter folder on its own: its export needs the target's lm_head (--target)
    if is_exported_drafter(path):
        raise InputPathError(f"{path} is already an exported drafter (config.json + model.safetensors): use it as "
                             f"it is (e.g. dflash-train eval --drafter {path}); {usage}")
    if not path.is_dir():
        raise InputPathError(f"{path} is a file: {usage}")
    raise InputPathError(f"{path} is not a training checkpoint: it lacks "
                         f"{_missing(path, (STATE, 'drafter/config.json', 'drafter/model.safetensors'))}; {usage}")


def require_exported_drafter(path: Path) -> Path:
    """`path` for `eval --drafter`: an exported drafter (or a checkpoint's drafter/ folder). A training
    checkpoint or a run raises InputPathError that names the export command or RUN/export."""
    path = Path(path)
    if is_exported_drafter(path):
        return path
    if is_checkpoint(path):
        run = RunDir(path.parent.parent)
        done = f", or use {run.export} (the run's own export)" if is_exported_drafter(run.export) else ""
        raise InputPathError(f"{path} is a training checkpoint, not an exported drafter: export it first with "
                             f"dflash-train export {path} --out DIR and pass --drafter DIR{done}")
    if path.is_dir() and is_run(path):
        run = RunDir(path)
        if is_exported_drafter(run.export):
            raise InputPathError(f"{path} is a training run: its exported drafter is {run.export} "
                                 f"(pass --drafter {run.export})")
        found = checkpoints_of(run.checkpoints)
        newest = found[0] if found else f"{run.checkpoints}/step-N"
        raise InputPathError(f"{path} is a training run without an export yet: export a checkpoint with "
                             f"dflash-train export {newest} --out DIR and pass --drafter DIR ({_newest(run.checkpoints)})")
    if not path.exists():
        raise InputPathError(f"--drafter {path} does not exist: pass an exported drafter folder "
                             "(config.json + model.safetensors, e.g. RUN/export)")
    raise InputPathError(f"{path} is not an exported drafter: it lacks {_missing(path, DRAFTER_FILES)} "
                         "(pass an exported drafter folder, e.g. RUN/export)")
