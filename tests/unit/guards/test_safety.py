"""Safety: what a run loads never executes code it was handed.

- Checkpoints and exports load without running code: weights through safetensors, optimizer.pt through
  torch.load(weights_only=True). A pickle whose __reduce__ would write a marker file, put in place of
  optimizer.pt (raw pickle and torch.save zip forms) or of model.safetensors, is refused and the marker
  never appears (a control shows the same payload does run under a plain pickle load).
- No trust_remote_code unless asked: every from_pretrained call in src/ passes trust_remote_code from the
  config or not at all, and a model folder whose auto_map points at a Python file that writes a marker
  is loaded by our target loaders without executing it.
- A checkpoint from another target or drafter shape is refused with both sides named.
"""

from __future__ import annotations

import ast
import io
import json
import os
import pickle
import shutil
import zipfile
from pathlib import Path

import pytest
import torch

from dflash_train.architectures.dflash.model import DFlashDrafter
from dflash_train.errors import DamagedFileError
from dflash_train.architectures.family.config import make_drafter_config
from dflash_train.architectures.io import load_drafter, save_drafter
from dflash_train.train.checkpoint import (CheckpointError, check_compatible, load_into, newest_valid, read_state,
                                           save_checkpoint)

SRC = Path(__file__).resolve().parents[3] / "src" / "dflash_train"


class Payload:
    """Unpickling this creates the marker file: proof that code ran."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _drafter(layers: int = 1, hidden: int = 64) -> DFlashDrafter:
    from transformers import LlamaConfig

    target = LlamaConfig(vocab_size=256, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4)
    dcfg = make_drafter_config(target, num_draft_layers=layers, block_size=4, target_layer_ids=[1, 3], mask_token_id=5)
    torch.manual_seed(0)
    return DFlashDrafter(dcfg)


def _parts(drafter):
    opt = torch.optim.AdamW(drafter.parameters(), lr=1e-3)
    for p in drafter.parameters():  # optimizer state with tensors, as after a step
        p.grad = torch.zeros_like(p)
    opt.step()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    return opt, sched


@pytest.fixture
def ckpt_root(tmp_path) -> Path:
    drafter = _drafter()
    opt, sched = _parts(drafter)
    root = tmp_path / "checkpoints"
    save_checkpoint(root, 4, drafter, opt, sched, {"epoch": 0, "batch_index": 4}, keep_last=3)
    save_checkpoint(root, 8, drafter, opt, sched, {"epoch": 0, "batch_index": 8}, keep_last=3)
    return root


def _evil_torch_zip(marker: Path) -> bytes:
    buf = io.BytesIO()
    torch.save({"optimizer": Payload(marker), "scheduler": {}}, buf)
    return buf.getvalue()


@pytest.mark.parametrize("form", ["raw pickle", "torch.save zip"])
def test_a_malicious_optimizer_pt_is_refused_not_executed(ckpt_root, tmp_path, form):
    marker = tmp_path / "PWNED"
    evil = pickle.dumps(Payload(marker)) if form == "raw pickle" else _evil_torch_zip(marker)
    newest = ckpt_root / "step-00000008"
    (newest / "optimizer.pt").write_bytes(evil)

    # Control: the payload is live; an unrestricted unpickler runs it.
    if form == "raw pickle":
        pickle.loads(evil)
    else:
        with zipfile.ZipFile(io.BytesIO(evil)) as z:
            name = next(n for n in z.namelist() if n.endswith("data.pkl"))
            pickle.loads(z.read(name))
    assert marker.exists()
    marker.unlink()

    # newest_valid skips it (falling back to the older checkpoint) and nothing ran.
    assert newest_valid(ckpt_root) == ckpt_root / "step-00000004"
    assert not marker.exists()
    drafter = _drafter()
    opt, sched = _parts(drafter)
    with pytest.raises(DamagedFileError, match="optimizer.pt is damaged .*Weights only load failed"):
        load_into(newest, drafter, opt, sched)
    assert not marker.exists()


def test_a_pickle_in_place_of_model_safetensors_is_refused_not_executed(ckpt_root, tmp_path):
    marker = tmp_path / "PWNED"
    newest = ckpt_root / "step-00000008"
    (newest / "drafter" / "model.safetensors").write_bytes(pickle.dumps(Payload(marker)))
    assert newest_valid(ckpt_root) == ckpt_root / "step-00000004"
    with pytest.raises(Exception):
        load_drafter(newest / "drafter")
    export = tmp_path / "export"
    save_drafter(_drafter(), export)
    (export / "model.safetensors").write_bytes(_evil_torch_zip(marker))
    with pytest.raises(Exception):
        load_drafter(export)
    assert not marker.exists()


# ------------------------------------------------------------------------------- loader call sites


def _calls(name: str):
    for path in sorted(SRC.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                func = node.func
                called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
                if called == name:
                    yield path, node


def test_every_torch_load_is_weights_only():
    calls = list(_calls("load"))
    torch_loads = [(p, n) for p, n in calls if isinstance(n.func, ast.Attribute)
                   and isinstance(n.func.value, ast.Name) and n.func.value.id == "torch"]
    assert torch_loads, "no torch.load found: the scan is broken"
    for path, node in torch_loads:
        kw = {k.arg: k.value for k in node.keywords}
        assert isinstance(kw.get("weights_only"), ast.Constant) and kw["weights_only"].value is True, \
            f"{path}:{node.lineno}: torch.load without weights_only=True"
    pickles = [(p, n.lineno) for p, n in list(_calls("loads")) + calls
               if isinstance(n.func, ast.Attribute) and getattr(n.func.value, "id", None) in ("pickle", "dill")]
    assert not pickles, f"pickle loads in src: {pickles}"


def test_every_from_pretrained_takes_trust_remote_code_from_the_config_or_not_at_all():
    """`trust_remote_code=` must be a variable (the config / CLI flag, default False), never `True`;
    through **kwargs, the dict must get it from a variable too."""
    found = 0
    for path, node in _calls("from_pretrained"):
        found += 1
        for k in node.keywords:
            if k.arg == "trust_remote_code":
                assert not isinstance(k.value, ast.Constant) or k.value.value is False, \
                    f"{path}:{node.lineno}: trust_remote_code={ast.unparse(k.value)}"
                assert isinstance(k.value, (ast.Name, ast.Attribute, ast.Constant)), ast.unparse(k.value)
    assert found >= 5, "the scan found too few from_pretrained calls"
    text = "\n".join(p.read_text() for p in SRC.rglob("*.py"))
    assert "trust_remote_code=True" not in text.replace(" ", "")
    from dflash_train.config.schema import Config

    assert Config().target.trust_remote_code is False


REMOTE_CODE = """
from pathlib import Path
Path({marker!r}).write_text("remote code ran")
from transformers import LlamaConfig, LlamaForCausalLM
class EvilConfig(LlamaConfig):
    model_type = "evil"
class EvilModel(LlamaForCausalLM):
    config_class = EvilConfig
"""


@pytest.mark.parametrize("model_type", ["evil", "llama"])
def test_a_model_folder_with_remote_code_is_not_executed(tiny_target_dir, tmp_path, monkeypatch, model_type):
    """auto_map points at evil.py, which writes a marker when imported. With the default config
    (trust_remote_code false) our loaders refuse an unknown model_type and ignore auto_map for a known one;
    the file never runs either way."""
    from dflash_train.target.capture import load_target_model, load_tokenizer, read_target_config

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    marker = tmp_path / "REMOTE_CODE_RAN"
    folder = tmp_path / "evil-target"
    shutil.copytree(tiny_target_dir, folder)
    (folder / "evil.py").write_text(REMOTE_CODE.format(marker=str(marker)))
    cfg = json.loads((folder / "config.json").read_text())
    cfg["model_type"] = model_type
    cfg["auto_map"] = {"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilModel"}
    (folder / "config.json").write_text(json.dumps(cfg))
    tok_cfg = json.loads((folder / "tokenizer_config.json").read_text())
    tok_cfg["auto_map"] = {"AutoTokenizer": ["evil.EvilTokenizer", None]}
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_cfg))

    attempts = {}
    for name, load in (("config", lambda: read_target_config(folder)),
                       ("tokenizer", lambda: load_tokenizer(folder)),
                       ("model", lambda: load_target_model(folder, torch.float32, torch.device("cpu")))):
        try:
            load()
            attempts[name] = "loaded with the built-in class"
        except Exception as e:  # refused: must say why (remote code), never run it
            attempts[name] = f"refused: {type(e).__name__}: {str(e)[:120]}"
            if model_type == "evil" and name != "tokenizer":
                assert "trust_remote_code" in str(e), e
        assert not marker.exists(), f"{name}: remote code ran"
    print(attempts)
    if model_type == "llama":
        assert attempts["model"] == "loaded with the built-in class"


# ------------------------------------------------------------------------------ incompatible checkpoints


def test_check_compatible_names_both_sides(ckpt_root):
    ckpt = ckpt_root / "step-00000008"
    state = {**read_state(ckpt), "tokenizer_sha256": "sha256:aaa", "drafter_shape": [1, 64, 128, 4],
             "target_layers": 4, "target_layer_ids": [1, 3]}
    expect = {"tokenizer_sha256": "sha256:bbb", "drafter_shape": [2, 64, 128, 4], "target_layers": 6,
              "target_layer_ids": [1, 3]}
    with pytest.raises(CheckpointError) as e:
        check_compatible(ckpt, state, expect)
    msg = str(e.value)
    assert f"cannot resume from {ckpt}" in msg
    for part in ("tokenizer_sha256: checkpoint 'sha256:aaa', this run 'sha256:bbb'",
                 "drafter_shape: checkpoint [1, 64, 128, 4], this run [2, 64, 128, 4]",
                 "target_layers: checkpoint 4, this run 6"):
        assert part in msg, msg
    assert "target_layer_ids" not in msg


def test_loading_weights_of_another_shape_names_both_shapes(ckpt_root):
    other = _drafter(layers=2, hidden=64)
    opt, sched = _parts(other)
    with pytest.raises(CheckpointError) as e:
        load_into(ckpt_root / "step-00000008", other, opt, sched)
    msg = str(e.value)
    assert "the drafter's tensors differ (11: layers.1.input_layernorm.weight: checkpoint absent, this run (64,)" in msg, msg
    wider = _drafter(layers=1, hidden=32)
    opt, sched = _parts(wider)
    with pytest.raises(CheckpointError, match=r"fc\.weight: checkpoint \(64, 128\), this run \(32, 64\)"):
        load_into(ckpt_root / "step-00000008", wider, opt, sched)


@pytest.mark.slow
def test_resuming_with_another_target_is_refused_naming_both(tmp_path, tokenizer_dir, tiny_target_dir, counting_jsonl,
                                                             capsys):
    """A real run on the 6-layer tiny target, then --resume in the same run directory with a 4-layer target."""
    from _harness import write_config
    from conftest import make_tiny_target
    from dflash_train.cli import main

    other = make_tiny_target(tmp_path / "four-layers", tokenizer_dir, layers=4, seed=1)
    run = tmp_path / "run"
    a = write_config(tmp_path / "a.yaml", tiny_target_dir, counting_jsonl, run__save_every=1)
    assert main(["train", str(a), "--run-dir", str(run), "--max-steps", "1"]) == 0
    b = write_config(tmp_path / "b.yaml", other, counting_jsonl, run__save_every=1)
    capsys.readouterr()
    assert main(["train", str(b), "--run-dir", str(run), "--max-steps", "2", "--resume"]) == 2
    err = capsys.readouterr().err  # the other config's target is a change a resume may not make
    assert f"'target.path' is '{tiny_target_dir}'" in err and f"'{other}' by the config file {b}" in err, err
    # the run's config.yaml pointed at the other target by hand: the checkpoint's record refuses it
    (run / "config.yaml").write_text((run / "config.yaml").read_text().replace(str(tiny_target_dir), str(other)))
    assert main(["train", "--run-dir", str(run), "--resume", "optim.max_steps=2"]) == 2
    err = capsys.readouterr().err
    assert "cannot resume from" in err and "target_layers: checkpoint 6, this run 4" in err, err
    assert json.loads((run / "status.json").read_text())["phase"] == "done"  # a refused resume writes nothing
