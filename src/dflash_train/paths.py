"""What a folder given on the command line is (a run, a training checkpoint, an exported drafter, a
model folder), and the one-line errors that say which command takes it instead."""

from __future__ import annotations

import json
import re
from pathlib import Path

from safetensors import SafetensorError, safe_open

from .errors import DamagedFileError, UserError
from .model.io import CONFIG_NAME, WEIGHTS_NAME
from .rundir import RunDir
from .runtime import read_json_file
from .train.checkpoint import STATE, list_checkpoints

DRAFTER_FILES = (CONFIG_NAME, WEIGHTS_NAME)  # an exported drafter
_STEP = re.compile(r"step-0*(\d+)")
_TOKENIZER_HINT = "tokenizer.json, or tokenizer.model / vocab files"
_WEIGHTS_HINT = "*.safetensors or pytorch_model*.bin"


class InputPathError(UserError):
    """A path that is not the kind of folder the command takes; the message says what it is and what fits."""


def is_checkpoint(path: Path) -> bool:
    return (path / STATE).is_file()


def has_drafter_files(path: Path) -> bool:
    return all((path / f).is_file() for f in DRAFTER_FILES)


def is_exported_drafter(path: Path) -> bool:
    """config.json + model.safetensors and no trainer_state.json (a checkpoint's drafter/ folder counts)."""
    return has_drafter_files(path) and not is_checkpoint(path)


def has_training_layout(path: Path) -> bool:
    """A drafter folder whose weights are a training-time layout the export turns into the reference one (DFlash2's
    factored selector codebooks: `dflash_config.selector_codebooks: factored`)."""
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and (config.get("dflash_config") or {}).get("selector_codebooks") == "factored"


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
    m = _STEP.fullmatch(path.name)
    for folder in folders:
        if m:
            hits = [p for p in list_checkpoints(folder)
                    if (n := _STEP.fullmatch(p.name)) and int(n.group(1)) == int(m.group(1))]
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


def _weight_files(path: Path) -> tuple[list[Path], list[str]]:
    """(weight files present, shards an index lists that are absent)."""
    found = sorted(path.glob("*.safetensors")) + sorted(path.glob("pytorch_model*.bin"))
    absent: list[str] = []
    for index in sorted(path.glob("*.index.json")):
        try:
            shards = set(json.loads(index.read_text()).get("weight_map", {}).values())
        except (OSError, json.JSONDecodeError, AttributeError):
            raise InputPathError(f"{index} is not a readable weight index (JSON with a weight_map): "
                                 "download the model folder again") from None
        absent += sorted(s for s in shards if not (path / s).is_file())
    return found, absent


def has_tokenizer(path: Path) -> bool:
    """Files a tokenizer loads from: tokenizer.json (fast), a sentencepiece *.model, Mistral's tekken.json,
    vocab files (vocab.json / vocab.txt) or *.tiktoken."""
    return any(next(path.glob(pattern), None) is not None for pattern in
               ("tokenizer.json", "tokenizer.model*", "*.model", "tekken.json", "vocab.json", "vocab.txt", "*.tiktoken"))


def check_model_folder(path: Path, weights: bool = True) -> None:
    """Refuse, in one line naming the folder and what is missing, a model folder that lacks config.json,
    a tokenizer or (with `weights`) its weights, before transformers tries to load it."""
    path = Path(path)
    missing = []
    if not (path / "config.json").is_file():
        missing.append("config.json")
    if not has_tokenizer(path):
        missing.append(f"a tokenizer ({_TOKENIZER_HINT})")
    if weights:
        found, absent = _weight_files(path)
        if absent:
            missing.append(f"weight shards listed in its index: {', '.join(absent[:4])}"
                           + (f" and {len(absent) - 4} more" if len(absent) > 4 else ""))
        elif not found:
            missing.append(f"weights ({_WEIGHTS_HINT})")
    if missing:
        raise InputPathError(f"{path} is not a complete model folder: missing {'; '.join(missing)}. Copy or "
                             "download the whole Hugging Face model folder (config, tokenizer and weights)")
    check_model_files(path, weights)


def check_model_files(path: Path, weights: bool = True) -> None:
    """config.json parses and (with `weights`) every *.safetensors file has a whole header and all the bytes it
    lists (not the tensors' values: reading them is loading the model); a damaged one raises DamagedFileError."""
    redo = f"copy or download the model folder {path} again"
    read_json_file(path / "config.json", redo)
    if not weights:
        return
    for file in sorted(path.glob("*.safetensors")):
        try:
            with safe_open(str(file), framework="pt"):
                pass
        except SafetensorError as e:
            raise DamagedFileError(file, f"not a readable safetensors file: {e}", redo,
                                   size=file.stat().st_size) from None
