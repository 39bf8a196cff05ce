"""The on-disk layout every command shares, without torch: the files that make a folder an exported drafter
(CONFIG_NAME and WEIGHTS_NAME, which architectures/io.py writes) or a training checkpoint (STATE, written last
by train's checkpoint writer), the name of a step's checkpoint folder, the complete checkpoints a folder holds, and
whether a folder is a complete model folder."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Optional

from safetensors import SafetensorError, safe_open

from ..errors import DamagedFileError, UserError
from .io import read_json_file

WEIGHTS_NAME = "model.safetensors"
CONFIG_NAME = "config.json"
STATE = "trainer_state.json"
DRAFTER_FILES = (CONFIG_NAME, WEIGHTS_NAME)  # an exported drafter
_STEP = re.compile(r"step-(\d+)")
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


def step_folder(step: int) -> str:
    """The name of step `step`'s checkpoint folder: `step-00000120`."""
    return f"step-{step:08d}"


def step_of(name: str) -> Optional[int]:
    """The step a checkpoint folder's name gives, zero-padded or not (`step-00000120`, `step-120`), else None."""
    m = _STEP.fullmatch(name)
    return int(m.group(1)) if m else None


def list_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints of the step-N rotation, oldest first."""
    if not root.is_dir():
        return []
    found = [(step, p) for p in root.iterdir()
             if (step := step_of(p.name)) is not None and p.is_dir() and (p / STATE).is_file()]
    return [p for _, p in sorted(found)]


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
