"""The on-disk layout every command shares, without torch: the files that make a folder an exported drafter
(CONFIG_NAME and WEIGHTS_NAME, which architectures/io.py writes) or a training checkpoint (STATE, which train/checkpoint.py
writes last), the complete checkpoints a folder holds, whether a folder is a complete model folder, and how a
finished output takes the place of an existing one (moved aside, never deleted)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Optional

from safetensors import SafetensorError, safe_open

from .errors import DamagedFileError, UserError
from .runtime import read_json_file

WEIGHTS_NAME = "model.safetensors"
CONFIG_NAME = "config.json"
STATE = "trainer_state.json"
DRAFTER_FILES = (CONFIG_NAME, WEIGHTS_NAME)  # an exported drafter
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


def list_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob("step-*") if p.is_dir() and (p / STATE).is_file())


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
            with safe_open(str(file), framework="pt") as f:
                f.keys()  # the header parsed; the tensors' bytes are not read
        except SafetensorError as e:
            raise DamagedFileError(file, f"not a readable safetensors file: {e}", redo,
                                   size=file.stat().st_size) from None


# ------------------------------------------------------------------------------------------ outputs


class OutputRefused(UserError):
    """An output path this command may not write (or may not replace without --overwrite)."""


def move_aside(path: Path) -> Path:
    """Rename `path` to a free `NAME.old-YYYYmmdd-HHMMSS[-k]` beside it (never deletes); returns the new name."""
    path = Path(path)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for k in range(1000):
        dest = path.with_name(f"{path.name}.old-{stamp}" + (f"-{k}" if k else ""))
        if not dest.exists():
            path.rename(dest)
            return dest
    raise FileExistsError(f"no free name to move {path} aside")


def put_in_place(tmp: Path, final: Path, overwrite: bool) -> Optional[Path]:
    """Rename the finished folder `tmp` to `final`. A non-empty `final` (admitted earlier by outputs.py's checks) is
    moved aside first; returns where it went, or None."""
    moved = None
    if holds_something(final):
        if not overwrite:  # it appeared while this command was working
            raise OutputRefused(f"{final} already exists; pass --overwrite to replace it or choose another --out")
        moved = move_aside(final)
    os.replace(tmp, final)
    return moved


def holds_something(path: Path) -> bool:
    if path.is_dir():
        return any(path.iterdir())
    return path.exists() and path.stat().st_size > 0
