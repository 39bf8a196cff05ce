"""How far a plan keeps the compiled graphs from 2^31 elements (train/plan/indexing.py): the element counts it
computes are the real tensors' of the compiled functions (recorded op by op on CPU), its plan maximum is the
brute-force one, a plan over 2^31 - 1 is warned about naming what to lower, and the trainer reports it (and
warns, then trains: the warm-up compiles the largest batches, so nothing recompiles mid-run). That inductor's 32-bit guard recompiles a kernel past 2^31 is checked on a GPU
(tests/gpu/)."""

import json
import re
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dflash_train.config.load import config_from_dict
from dflash_train.data.dataset import plan_batches
from dflash_train.accel import compile as compile_layer
from dflash_train.target import capture as target_mod
from dflash_train.architectures.family.backend import AttentionBackend
from dflash_train.architectures.attention import sdpa_attention
from dflash_train.architectures.dflash.model import DFlashDrafter
from dflash_train.architectures.family.config import make_drafter_config
from dflash_train.architectures.family.mask import dense_mask
from dflash_train.train.plan import indexing
from dflash_train.train.plan.size_classes import block_bound

BS = 4


class _Largest(TorchDispatchMode):
    """The largest element count of any tensor an op reads or writes while active, weights left out (fixed
    sizes: the plan never moves them across 2^31)."""

    def __init__(self, weights: set[int]):
        super().__init__()
        self.most, self.weights = 0, weights

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves((args, kwargs, out)):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in self.weights:
                self.most = max(self.most, t.numel())
        return out


@pytest.fixture
def recorded(monkeypatch):
    """`compile.compiled` replaced by a recorder: each "compiled" function runs eagerly and notes its largest
    tensor (forward; its backward's tensors are the gradients of these and have their shapes)."""
    most: dict[str, int] = {}
    weights: set[int] = set()

    def compiled(name, fn, **_kwargs):
        def call(*args, **kwargs):
            with _Largest(weights) as seen:
                out = fn(*args, **kwargs)
            most[name.split("[")[0]] = max(most.get(name.split("[")[0], 0), seen.most)
            return out
        return call

    monkeypatch.setattr(compile_layer, "compiled", compiled)
    monkeypatch.setattr(target_mod, "_COMPILE_DEVICES", ("cuda", "cpu"))
    return most, weights


def _qwen3(**over):
    from transformers import Qwen3Config

    return Qwen3Config(**{"hidden_size": 64, "intermediate_size": 176, "num_hidden_layers": 4,
                          "num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 1000,
                          **over})


def _cfg(**objective):
    return config_from_dict({"drafter": {"block_size": BS, "compile": True}, "target": {"compile": True},
                             "objective": {"loss_chunk_size": 300, **objective}, "run": {"device": "cuda"}})


@pytest.mark.parametrize("b,s,n", [(3, 45, 5), (1, 20, 9), (2, 31, 2)])
def test_the_counts_are_the_largest_tensors_of_the_compiled_functions(recorded, b, s, n):
    from transformers import AutoModelForCausalLM

    recorded, weights = recorded
    tcfg = _qwen3()
    dcfg = make_drafter_config(tcfg, num_draft_layers=2, block_size=BS, target_layer_ids=[1, 2], mask_token_id=3,
                               intermediate_size=200, num_attention_heads=8, num_key_value_heads=2, head_dim=16)
    drafter = DFlashDrafter(dcfg)
    model = AutoModelForCausalLM.from_config(tcfg).eval()
    weights.update(p.untyped_storage().data_ptr() for m in (drafter, model) for p in m.parameters())
    drafter.compile_layers(backend="eager")
    g = torch.Generator().manual_seed(s)
    anchors = torch.stack([torch.randperm(s - BS, generator=g)[:n].sort().values for _ in range(b)])
    keep = torch.ones(b, n, dtype=torch.bool)
    position_ids = torch.cat([torch.arange(s).expand(b, s), (anchors.unsqueeze(-1) + torch.arange(BS)).view(b, -1)], 1)
    out = drafter(torch.randn(b, s, 2 * 64), torch.randn(b, n * BS, 64, requires_grad=True), position_ids,
                  sdpa_attention, dense_mask(anchors, keep, s, BS), compiled_layers=True)
    out.float().pow(2).mean().backward()
    target = target_mod.TargetCapture.from_model(model, [1, 2], compile=True)
    target.capture(torch.randint(0, 1000, (b, s), generator=g), with_final=True)

    widths = indexing.compiled_widths(_cfg(), dcfg, tcfg, AttentionBackend("sdpa", sdpa_attention, 1), True)
    terms = {what.split(" (")[0]: int(v[0]) for what, v in widths.terms(np.array([b]), np.array([s]),
                                                                        np.array([n])).items()}
    assert recorded["target_layer"] == terms["the target's layers"]  # the MLP's activations: 176 a token
    assert recorded["drafter_output_and_mlp"] == terms["the drafter's layers over the blocks"]  # 200 a slot
    # over the context the drafter's layers hold its hidden states (64) and keys and values (2 x 16)
    assert recorded["drafter_attention_inputs"] == max(terms["the drafter's layers over the context"],
                                                       b * n * BS * 8 * 16)  # and the block's queries
    assert terms["the loss chunk's logits"] == min(300, b * n * BS) * 1000
    assert terms["flex attention's queries"] == 0 and terms["flex attention's keys"] == 0  # sdpa: not compiled


def test_flex_counts_keys_of_the_padded_context_and_the_blocks():
    dcfg = SimpleNamespace(hidden_size=64, head_dim=16, num_attention_heads=8, num_key_value_heads=2, block_size=BS,
                           intermediate_size=200)
    widths = indexing.compiled_widths(_cfg(), dcfg, _qwen3(), AttentionBackend("flex", sdpa_attention, 8, 128), True)
    terms = {what.split(" (")[0]: int(v[0]) for what, v in widths.terms(np.array([3]), np.array([300]),
                                                                        np.array([16])).items()}
    assert terms["flex attention's keys"] == 3 * (384 + 16 * BS) * 2 * 16  # context padded to whole tiles
    assert terms["flex attention's queries"] == 3 * 16 * BS * 8 * 16
    assert terms["the drafter's layers over the context"] == 3 * 384 * 64


@pytest.mark.parametrize("max_batch_anchors", [0, 96])
def test_the_plan_maximum_is_the_brute_force_one_over_every_epoch(max_batch_anchors):
    lengths = np.random.default_rng(0).integers(20, 900, 500)
    dcfg = SimpleNamespace(hidden_size=64, head_dim=16, num_attention_heads=8, num_key_value_heads=2, block_size=BS,
                           intermediate_size=200)
    widths = indexing.compiled_widths(_cfg(), dcfg, _qwen3(), AttentionBackend("flex", sdpa_attention, 8, 128), True)
    got = indexing.largest_tensor(widths, lengths, 4096, 12, 7, range(0, 3), 48, max_batch_anchors, 8)
    best = (0, None)
    for epoch in range(3):
        for rows in plan_batches(lengths, 4096, 12, 7, epoch):
            b, s = len(rows), int(lengths[rows].max())
            n = int(block_bound(np.array([b]), np.array([s]), BS, 48, max_batch_anchors, 8)[0])
            sp, q = -(-s // 128) * 128, n * BS
            count = max(b * s * 176, b * sp * 64, b * q * 200, b * q * 128, b * (sp + q) * 32, min(300, b * q) * 1000)
            if count > best[0]:
                best = (count, (epoch, b, s, n))
    assert got.elements == best[0] and (got.epoch, got.rows, got.context, got.blocks) == best[1]
    assert got.headroom == pytest.approx(indexing.INT32_MAX / best[0])
    assert f"{best[0]:,} elements" in got.describe() and "below 2^31 - 1" in got.describe()


def test_a_plan_over_two_to_the_31_is_warned_about_naming_what_to_lower():
    """A Qwen3-8B-shaped target: 65,536-token micro-batches keep its compiled layers 2.67x below 2^31; a
    loss chunk of 16,384 rows of a 151,936-token vocabulary would cross it."""
    t = _qwen3(hidden_size=4096, intermediate_size=12288, num_attention_heads=32, num_key_value_heads=8,
               head_dim=128, vocab_size=151936)
    dcfg = SimpleNamespace(hidden_size=4096, head_dim=128, num_attention_heads=32, num_key_value_heads=8, block_size=BS,
                           intermediate_size=12288)
    lengths = np.full(64, 4096)
    backend = AttentionBackend("flex", sdpa_attention, 8, 128)
    ok = indexing.largest_tensor(indexing.compiled_widths(_cfg(loss_chunk_size=4096), dcfg, t, backend, True), lengths,
                                 65536, 16, 0, range(1), 512, 0, 8)
    assert ok.elements == 65536 * 12288 and ok.what.startswith("the target's layers") and ok.headroom > 2.6
    assert indexing.over_limit_warning(ok) is None
    over = indexing.largest_tensor(indexing.compiled_widths(_cfg(loss_chunk_size=16384), dcfg, t, backend, True),
                                   lengths, 65536, 16, 0, range(1), 512, 0, 8)
    assert over.elements == 16384 * 151936
    assert re.search(r"2,489,319,424 elements \(the loss chunk's logits \(rows x vocab: "
                     r"objective.loss_chunk_size\).*over 2\^31 - 1 = 2,147,483,647.*64-bit.*1.16x",
                     indexing.over_limit_warning(over))
    nothing = indexing.largest_tensor(indexing.compiled_widths(
        config_from_dict({}), dcfg, t, AttentionBackend("sdpa", sdpa_attention, 1), False), lengths, 65536, 16, 0,
        range(1), 512, 0, 8)
    assert nothing.elements == 0 and "nothing of this run is compiled" in nothing.describe()
    assert indexing.over_limit_warning(nothing) is None


def _cpu_compile_run(monkeypatch, tiny_target_dir, counting_jsonl):
    import dflash_train.config.validate as config_mod
    from dflash_train.architectures.family import model as drafter_mod
    from dflash_train.train.start import rank_checks
    from dflash_train.train import trainer

    monkeypatch.setattr(config_mod, "validate_compile_device", lambda *a: None)
    monkeypatch.setattr(rank_checks, "validate_compile_device", lambda *a: None)
    monkeypatch.setattr(drafter_mod, "COMPILE_BACKEND", "eager")
    return trainer, config_from_dict({
        "target": {"path": str(tiny_target_dir)},
        "drafter": {"num_draft_layers": 1, "block_size": 4, "attention_backend": "sdpa", "compile": True},
        "data": {"train_files": [str(counting_jsonl)], "max_length": 256, "token_budget": 512, "max_batch_size": 2},
        "objective": {"max_anchors": 16, "gamma": 4.0},
        "optim": {"lr": 3e-3, "epochs": 10, "warmup_ratio": 0.05},
        "run": {"device": "cpu", "log_every": 1, "save_every": 100, "progress_bar": False, "eval_every": 0},
    })


def test_the_trainer_reports_the_headroom_and_warns_over_the_limit(tmp_path, tiny_target_dir, counting_jsonl,
                                                                          monkeypatch):
    """drafter.compile on CPU (the device check lifted, Dynamo's eager backend): status.json carries the plan's
    largest compiled tensor and its headroom; with the limit lowered below it the run warns (64-bit kernels, no
    recompile: the warm-up runs the largest batches) and trains."""
    trainer, cfg = _cpu_compile_run(monkeypatch, tiny_target_dir, counting_jsonl)
    torch._dynamo.reset()
    trainer.train(cfg, tmp_path / "R", max_steps=2)
    status = json.loads((tmp_path / "R" / "status.json").read_text())
    assert status["phase"] == "done", status
    # the drafter's layers over the context (64 a position) of the fullest micro-batch (<= 512 tokens, padding in)
    largest = status["index_largest_elements"]
    assert largest % 64 == 0 and 256 * 64 < largest <= 512 * 64, status
    assert status["index_headroom"] == round(indexing.INT32_MAX / largest, 2)

    assert status["index_64bit_kernels"] is False
    monkeypatch.setattr(indexing, "INT32_MAX", largest - 1)
    trainer.train(cfg, tmp_path / "over", max_steps=2)
    status = json.loads((tmp_path / "over" / "status.json").read_text())
    assert status["phase"] == "done" and status["index_64bit_kernels"] is True, status
    log = (tmp_path / "over" / "train.log").read_text()
    assert re.search(rf"{largest:,} elements \(the drafter's layers over the context \(b x s: data.token_budget\).*"
                     r"over 2\^31 - 1.*64-bit", log), log[-2000:]
    torch._dynamo.reset()


@pytest.mark.parametrize("max_batch_anchors", [0, 40])
def test_block_counts_from_the_datas_anchor_positions_are_sample_anchors_own(tiny_target_dir, counting_jsonl,
                                                                             max_batch_anchors):
    """Rows supervised on their answers only: the block count a batch gets, computed from each row's anchor
    positions without collating anything, is the one `sample_anchors` draws on the collated batch."""
    from dflash_train.data.batch import collate
    from dflash_train.data.source import open_training_data
    from dflash_train.target.capture import load_tokenizer
    from dflash_train.architectures.family.blocks import sample_anchors
    from dflash_train.architectures.family.blocks import blocks_for

    cfg = config_from_dict({"target": {"path": str(tiny_target_dir)}, "drafter": {"block_size": BS},
                            "data": {"train_files": [str(counting_jsonl)], "max_length": 256}})
    data = open_training_data(cfg, load_tokenizer(tiny_target_dir), BS)
    positions = data.anchor_positions
    assert (positions < data.lengths - BS + 1).all()  # the prompts are not supervised
    g = torch.Generator().manual_seed(0)
    for rows in plan_batches(data.lengths, 600, 4, 0, 0)[:12]:
        batch = collate([data.example(i) for i in rows], 2)
        for max_anchors in (16, 200):
            anchors, _ = sample_anchors(batch.loss_mask, batch.lengths, BS, max_anchors, g, 8, max_batch_anchors)
            n = blocks_for(np.array([len(rows)]), np.array([positions[rows].max()]), max_anchors, max_batch_anchors, 8)
            assert anchors.shape[1] == int(n[0]), (rows, max_anchors)


def test_a_prepared_datasets_anchor_positions_bound_the_real_ones(tmp_path, tiny_target_dir, counting_jsonl):
    """A prepared dataset gives its supervised tokens (counted before a shorter data.max_length cuts rows, and
    its last block's among them): never fewer than the positions that can anchor a block, never more than a
    row's length allows."""
    from dflash_train.commands.prepare import PrepareConfig, prepare
    from dflash_train.data.source import open_training_data
    from dflash_train.target.capture import load_tokenizer

    tok = load_tokenizer(tiny_target_dir)
    prepare(tok, str(tiny_target_dir), [str(counting_jsonl)], tmp_path / "prep",
            PrepareConfig(max_length=256, block_size=BS, val_fraction=0.0))
    for max_length in (256, 120):
        cfg = config_from_dict({"target": {"path": str(tiny_target_dir)}, "drafter": {"block_size": BS},
                                "data": {"train_files": [str(tmp_path / "prep")], "max_length": max_length,
                                         "token_budget": 1024}})
        data = open_training_data(cfg, tok, BS)
        exact = [int(np.count_nonzero(data.example(i).loss_mask[:int(data.lengths[i]) - BS + 1]))
                 for i in range(len(data))]
        assert (data.anchor_positions >= exact).all() and (data.anchor_positions <= data.lengths - BS + 1).all()
        if max_length == 256:  # nothing cut: off by the supervised tokens of a row's last block at most
            assert (data.anchor_positions - exact <= BS - 1).all()
