"""The activation estimate (train/plan/activation_memory.py) against the live tensors of real eager runs on CPU: a capture
of tiny random Qwen3 targets (dense and MoE) and real drafter training steps (dflash, dflash2, dspark; float32 and bfloat16
autocast), measured op by op (tests/helpers/_live_bytes.py). The estimate must bound the measured peak, stay within 2.5x
of it, and each shape's dominant named part must be needed (the estimate without it falls below the measurement)."""

import numpy as np
import pytest
import torch
from _live_bytes import LiveBytes
from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from dflash_train.architectures import architecture
from dflash_train.architectures.family.backend import resolve_backend
from dflash_train.architectures.family.blocks import sample_anchors
from dflash_train.config.load import config_from_dict
from dflash_train.data.batch import Batch
from dflash_train.train.plan import activation_memory as am
from dflash_train.train.plan.preflight import drafter_parameters
from dflash_train.train.loop.step import TrainStep

LOOSEST = 2.5


def _target(moe: bool = False, **shape):
    torch.manual_seed(0)
    fields = {**dict(hidden_size=64, intermediate_size=192, num_hidden_layers=6, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, vocab_size=2000), **shape}
    if moe:
        cfg = Qwen3MoeConfig(**fields, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=96,
                             decoder_sparse_step=1, mlp_only_layers=[])
        return Qwen3MoeForCausalLM(cfg).eval().requires_grad_(False)
    return Qwen3ForCausalLM(Qwen3Config(**fields)).eval().requires_grad_(False)


def _config(rows: int, length: int, block: int, anchors: int, chunk: int, arch: str = "dflash", layers: int = 2):
    """`arch`: an architecture name, or dflash2:factored (its selector's codebooks factored through the head)."""
    arch, _, codebooks = arch.partition(":")
    extra = {"selector_codebooks": codebooks} if codebooks else {}
    own = {"domino": {"gru_hidden_dim": 256, "emb_dim": 64},
           "lilicorr": {"candidate_topk": 8, "head_hidden_size": 128, "head_num_heads": 4, "factor_dim": 128}}
    sections = {arch: own[arch]} if arch in own else {}
    return config_from_dict({**sections,
                             "drafter": {"block_size": block, "num_draft_layers": layers, "attention_backend": "sdpa",
                                         "architecture": arch, **extra},
                             "objective": {"max_anchors": anchors, "loss_chunk_size": chunk},
                             "data": {"max_length": length, "token_budget": rows * length, "max_batch_size": rows}})


def _ids(model, rows: int, length: int) -> torch.Tensor:
    return torch.randint(0, model.config.vocab_size, (rows, length), generator=torch.Generator().manual_seed(0))


def _assert_bounds(estimate: dict[str, int], measured: int, needed: str) -> None:
    total = sum(estimate.values())
    assert measured <= total <= LOOSEST * measured, (measured, total, estimate)
    assert total - estimate[needed] < measured, (needed, measured, estimate)  # the part is not slack


CAPTURES = {  # name: (target shape, moe, captured layers, rows, length, the part that must be counted)
    "captured states dominate": (dict(hidden_size=128, intermediate_size=64), False, [0, 1, 2, 3, 4], 3, 100,
                                 "captured states"),
    "the MLP dominates": (dict(intermediate_size=1024), False, [1, 3, 4], 2, 128, "capture transient"),
    "a MoE target": (dict(), True, [1, 3, 4], 2, 128, "capture transient"),
}


@pytest.mark.parametrize("case", list(CAPTURES))
def test_the_capture_estimate_bounds_the_live_bytes_of_a_real_capture(case):
    from dflash_train.target.capture import TargetCapture

    shape, moe, ids, rows, length, needed = CAPTURES[case]
    model = _target(moe, **shape)
    capture = TargetCapture.from_model(model, ids)
    tokens = _ids(model, rows, length)
    with LiveBytes() as live:
        out = capture(tokens)
    assert out.shape == (rows, length, len(ids) * model.config.hidden_size)
    estimate = am.capture_parts(model.config, ids, am.MicroBatchShape(rows, length, 1, 4), 4)
    _assert_bounds(estimate, live.peak, needed)


STEPS = {  # name: (target shape, architecture, rows, length, block, anchors, CE chunk, compute dtype, needed part)
    "the CE chunk dominates": (dict(vocab_size=8000), "dflash", 2, 128, 16, 4, 128, torch.float32,
                               "lm_head + CE chunk"),
    "the drafter layers dominate": (dict(intermediate_size=1024), "dflash", 2, 128, 30, 4, 64, torch.float32,
                                    "drafter layers"),
    "the captured states count": (dict(hidden_size=128, intermediate_size=64, vocab_size=500), "dflash", 3, 100, 4, 2,
                                  64, torch.float32, "captured states"),
    "dflash2's selector": (dict(), "dflash2", 2, 128, 16, 4, 64, torch.float32, "selector"),
    "dflash2's factored codebooks": (dict(vocab_size=30000), "dflash2:factored", 2, 64, 8, 2, 64, torch.float32,
                                     "selector"),
    "bfloat16 autocast": (dict(), "dflash", 2, 128, 16, 4, 64, torch.bfloat16, "lm_head + CE chunk"),
    "dspark's chunk against the target's distribution": (dict(vocab_size=8000), "dspark", 2, 128, 16, 4, 128,
                                                          torch.float32, "lm_head + CE chunk"),
    "domino's correction": (dict(vocab_size=1000), "domino", 2, 128, 16, 4, 128, torch.float32, "domino_correction"),
    "domino's chunk, both terms": (dict(vocab_size=8000), "domino", 2, 128, 16, 4, 128, torch.float32,
                                   "lm_head + CE chunk"),
    "lilicorr's lattice": (dict(vocab_size=1000), "lilicorr", 2, 128, 16, 8, 128, torch.float32,
                           "lilicorr lattice chunk"),
    "lilicorr's lattice, bfloat16 autocast": (dict(vocab_size=1000), "lilicorr", 2, 128, 16, 8, 128, torch.bfloat16,
                                              "lilicorr lattice chunk"),
    "lilicorr's lattice on a wider drafter": (dict(hidden_size=512, vocab_size=1000), "lilicorr", 2, 128, 16, 8, 128,
                                              torch.float32, "lilicorr lattice chunk"),
}


@pytest.mark.parametrize("case", list(STEPS))
def test_the_step_estimate_bounds_the_live_bytes_of_a_real_training_step(case):
    """One colocated training step (capture included), after a first step made the optimizer state: what it
    allocates minus the parameters' gradients (weights' memory, counted by preflight.needed_bytes)."""
    _step_estimate_bounds_the_step(*STEPS[case])


def test_lilicorrs_estimate_follows_the_runs_chunk_of_the_lattice(monkeypatch):
    """LiLiCorr's head runs in the run's chunks (`head.chunk_blocks`: at least CHUNK_NODES nodes, at most MAX_CHUNKS
    chunks): with a least chunk of 2 blocks and at most 2 chunks, the 16 blocks of the step take 2 chunks of 8,
    and the estimate bounds that step too."""
    from dflash_train.architectures.lilicorr import head

    monkeypatch.setattr(head, "CHUNK_NODES", 2 * 15 * 8)
    monkeypatch.setattr(head, "MAX_CHUNKS", 2)
    assert head.chunk_blocks(16, 15, 8) == 8
    _step_estimate_bounds_the_step(*STEPS["lilicorr's lattice"])


@pytest.mark.parametrize("rows,budget,length,anchors,per_batch,multiple", [
    (16, 16384, 1024, 512, 0, 1), (64, 16384, 1024, 500, 0, 8), (4, 8192, 2048, 512, 0, 8), (8, 4096, 4096, 64, 300, 1),
    (3, 40, 40, 8, 0, 1)])
def test_the_most_blocks_a_micro_batch_is_the_estimates_largest_micro_batch(rows, budget, length, anchors, per_batch,
                                                                            multiple):
    """`family.blocks.most_blocks` (what sizes LiLiCorr's chunks) is the largest of the estimate's largest
    micro-batches, so the chunk the estimate counts is the one the run takes."""
    from dflash_train.architectures.family.blocks import most_blocks

    cfg = config_from_dict({"drafter": {"block_size": 16}, "objective": {"max_anchors": anchors,
                                                                         "max_anchors_per_batch": per_batch},
                            "data": {"max_length": length, "token_budget": budget, "max_batch_size": rows}})
    largest = max(s.rows * s.blocks for s in am.largest_micro_batches(cfg, multiple, 16))
    assert most_blocks(rows, budget, length, 16, anchors, per_batch, multiple) == largest


def _step_estimate_bounds_the_step(shape, arch, rows, length, block, anchors, chunk, dtype, needed) -> None:
    from dflash_train.target.capture import TargetCapture

    model = _target(**shape)
    ids = [0, 1, 2, 3, 4] if shape.get("hidden_size") == 128 else [1, 3, 4]
    cfg = _config(rows, length, block, anchors, chunk, arch)
    arch = cfg.drafter.architecture
    dcfg = architecture(arch).config_for_run(model.config, cfg, ids, 5)
    torch.manual_seed(1)
    drafter = architecture(arch).drafter_class(dcfg)
    capture = TargetCapture.from_model(model, ids)
    step = TrainStep(drafter, capture, resolve_backend("sdpa", torch.device("cpu"), block), cfg, 100, dtype,
                     torch.device("cpu"), replicas=1)
    tokens = _ids(model, rows, length)
    batch = Batch(tokens, torch.ones_like(tokens), torch.full((rows,), length))
    step(batch, 0)
    with LiveBytes() as live:
        step(batch, 1)
    grads = sum(p.numel() * p.element_size() for p in drafter.parameters())
    estimate = am.activation_estimate("colocated", cfg, model.config, dcfg, ids, torch.float32, dtype, "cpu",
                                      drafter_parameters(architecture(arch), dcfg))
    assert estimate.shape == am.MicroBatchShape(rows, length, anchors, block)
    _assert_bounds(estimate.parts, live.peak - grads, needed)


@pytest.mark.parametrize("max_anchors,per_batch,multiple", [(8, 0, 1), (40, 0, 8), (40, 24, 8), (5, 0, 1)])
def test_the_largest_micro_batches_bound_every_batch_the_keys_allow(max_anchors, per_batch, multiple):
    """Random micro-batches within data.max_batch_size / max_length / token_budget: their real anchors
    (`sample_anchors`) never give more query tokens than the largest shape of their row count, nor more tokens."""
    cfg = config_from_dict({"drafter": {"block_size": 4},
                            "objective": {"max_anchors": max_anchors, "max_anchors_per_batch": per_batch},
                            "data": {"max_length": 60, "token_budget": 150, "max_batch_size": 5}})
    shapes = {s.rows: s for s in am.largest_micro_batches(cfg, multiple, 4)}
    assert sorted(shapes) == [1, 2, 3, 4, 5] and shapes[1].context == 60 and shapes[5].context == 30
    rng = np.random.default_rng(0)
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        rows = int(rng.integers(1, 6))
        lengths = torch.as_tensor(rng.integers(8, min(60, 150 // rows) + 1, rows))
        width = int(lengths.max())
        mask = (torch.arange(width).view(1, -1) < lengths.view(-1, 1)).long()
        anchors, _ = sample_anchors(mask, lengths, 4, max_anchors, g, multiple, per_batch)
        assert rows * anchors.shape[1] * 4 <= shapes[rows].queries and rows * width <= shapes[rows].tokens


def test_a_plan_whose_activations_cannot_fit_stops_before_loading_naming_the_token_budget(tiny_target_dir):
    """The trainer's preflight (`rank_need`, then `check_gpu`) from the config and the checkpoint's headers alone,
    against a pretend free-memory figure: the weights fit, the activations of a 64K-token micro-batch do not; the
    message gives the parts and names data.token_budget first; a quarter of the budget fits."""
    from dflash_train.target.capture import read_target_config
    from dflash_train.errors import UserError
    from dflash_train.train.plan.preflight import MARGIN, check_gpu, rank_need

    tc = read_target_config(tiny_target_dir)

    def need(token_budget: int):
        cfg = config_from_dict({"target": {"path": str(tiny_target_dir)}, "drafter": {"num_draft_layers": 2},
                                "data": {"max_length": 4096, "token_budget": token_budget, "max_batch_size": 16}})
        ids = [1, 3]
        dcfg = architecture("dflash").config_for_run(tc, cfg, ids, 5)
        return rank_need(cfg, tiny_target_dir, tc, dcfg, ids, torch.bfloat16, torch.bfloat16, "colocated", False,
                         arch=architecture("dflash"))

    big, what = need(65536)
    small, _ = need(4096)
    assert big.activations.total > 4 * big.weights and big.total == big.weights + big.activations.total + MARGIN
    assert small.weights == big.weights and small.activations.total < big.activations.total
    free = (small.total + big.total) // 2

    def pretend(_device):
        return free, 8 * 2**30

    with pytest.raises(UserError) as refused:  # the user's to fix: one message, exit 2, no traceback
        check_gpu(torch.device("cuda", 0), big, 0, what, free_memory=pretend)
    message = str(refused.value)
    assert message.index("data.token_budget") < message.index("target.sharding=fsdp"), message
    assert "activations" in message and "weights and optimizer state" in message and "lm_head + CE chunk" in message
    assert "rank 0 on cuda:0" in message and "16 x 4096 tokens" in message
    check_gpu(torch.device("cuda", 0), small, 0, what, free_memory=pretend)  # fits: no error
