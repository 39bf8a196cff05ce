"""The FLOP accounting of train/loop/flops.py (the training loop's metrics and the throughput benchmarks): its formula
against the matmuls a tiny real target and drafter run, counted by torch's FlopCounterMode on the CPU, and the
efficiency fields' arithmetic."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import AutoModelForCausalLM, Qwen3Config

from dflash_train.architectures import architecture
from dflash_train.architectures.stats import DraftWork
from dflash_train.architectures.family.backend import resolve_backend
from dflash_train.architectures.family.blocks import sample_anchors
from dflash_train.architectures.family.config import make_drafter_config
from dflash_train.architectures.family.mask import dense_mask
from dflash_train.architectures.dflash.model import DFlashDrafter
from dflash_train.config.load import config_from_dict
from dflash_train.data.batch import Batch
from dflash_train.target.capture import TargetCapture
from dflash_train.train.loop import flops

H, BS, LAYER_IDS = 64, 4, [0, 2]


def _step_under_flop_counter(draft_vocab: int = 0):
    """One micro-batch of the DFlash objective, forward and backward, on rows of equal length (no padding, every
    block kept: what runs is what counts); returns (counted matmul FLOPs, stats, target shape, drafter)."""
    torch.manual_seed(0)
    tcfg = Qwen3Config(hidden_size=H, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, vocab_size=300)
    model = AutoModelForCausalLM.from_config(tcfg).eval().requires_grad_(False)
    target = TargetCapture.from_model(model, LAYER_IDS)
    dcfg = make_drafter_config(tcfg, num_draft_layers=2, block_size=BS, target_layer_ids=LAYER_IDS, mask_token_id=5,
                               intermediate_size=80, num_attention_heads=2, draft_vocab_size=draft_vocab)
    drafter = DFlashDrafter(dcfg)
    if draft_vocab:
        drafter.set_draft_vocabulary(torch.arange(draft_vocab), model.lm_head.weight)
    cfg = config_from_dict({"drafter": {"block_size": BS, "num_draft_layers": 2, "attention_backend": "sdpa",
                                        "draft_vocab_size": draft_vocab},
                            "objective": {"max_anchors": 6}})
    backend = resolve_backend("sdpa", torch.device("cpu"), BS)
    objective = architecture("dflash").objective(drafter, target, backend, cfg, torch.float32)
    ids = torch.randint(10, 300, (2, 40), generator=torch.Generator().manual_seed(1))
    batch = Batch(ids, torch.ones_like(ids), torch.tensor([40, 40]))
    with FlopCounterMode(display=False) as counter:
        stats = objective(batch, torch.Generator().manual_seed(0))
        stats.loss.backward()
    counts = counter.get_flop_counts()["Global"]
    # On the CPU, FlopCounterMode counts no sdpa kernel: its matmuls are the linears and the vocabulary head.
    assert set(counts) == {torch.ops.aten.mm}, counts
    return counts[torch.ops.aten.mm], stats, flops.model_shape(tcfg), drafter


@pytest.mark.parametrize("draft_vocab", [0, 128])
def test_the_formula_counts_the_matmuls_that_run(draft_vocab):
    """Every matmul of the capture, the drafter's forward and backward and the vocabulary head, FLOP for FLOP; the
    one the formula counts and the step skips is the fc's input gradient (the capture needs none: MFU's usual 3x
    forward). The target's frozen head: forward and input gradient; a trained draft head: its weight gradient too."""
    counted, stats, target_shape, drafter = _step_under_flop_counter(draft_vocab)
    work = stats.work
    assert work == DraftWork(blocks=12, block_tokens=48, attended=work.attended, counted_rows=36)
    assert work.counted_rows == int(stats.counted_per_slot.sum()) and work.blocks == int(stats.kept_blocks)
    target = flops.target_flop_parts(target_shape, [40, 40], max(LAYER_IDS))
    drafter_parts = flops.drafter_flop_parts(flops.drafter_shape(drafter), 80, work, 2, len(LAYER_IDS))
    fc_input_gradient = 2 * 80 * len(LAYER_IDS) * H * H
    assert counted == target["linears"] + drafter_parts["linears"] - fc_input_gradient + drafter_parts["lm_head"]
    assert drafter_parts["lm_head"] == 2 * 36 * H * (draft_vocab or 300) * (3 if draft_vocab else 2)


def test_the_attended_pairs_are_the_masks_unmasked_entries():
    """`DraftWork.attended`, per kept block (its queries see the context before the anchor and their own block),
    equals the sdpa mask's True entries; blocks not kept count nothing (rows of different lengths)."""
    g = torch.Generator().manual_seed(3)
    lengths = torch.tensor([50, 23, 37])
    loss_mask = (torch.rand(3, 50, generator=g) < 0.7).long()
    anchors, keep = sample_anchors(loss_mask, lengths, BS, 5, g, multiple_of=4)
    assert not keep.all()  # padded with blocks not kept
    work = DraftWork.of(anchors, keep, BS, 0)
    assert work.attended == int(dense_mask(anchors, keep, 50, BS).sum())
    assert work.blocks == int(keep.sum()) and work.block_tokens == BS * int(keep.sum())


def test_target_attention_counts_the_causal_pairs():
    shape = dict(hidden_size=8, num_attention_heads=2, num_key_value_heads=1, head_dim=4, intermediate_size=16)
    parts = flops.target_flop_parts(shape, [3, 5], last_layer=1)
    pairs = int(torch.ones(3, 3).tril().sum() + torch.ones(5, 5).tril().sum())
    assert parts["attention"] == 4 * 2 * 4 * pairs * 2
    assert parts["linears"] == 2 * (8 * 2 * 4 * 2 + 8 * 1 * 4 * 2 + 3 * 8 * 16) * 2 * 8


def test_efficiency_fields_add_up_and_need_a_peak_for_mfu():
    f = flops.efficiency_fields(target=6e12, drafter=2e12, blocks=300, steps=2, seconds=4.0, peak=1000.0)
    assert f["step_flops"] == f["target_flops"] + f["drafter_flops"] == 4e12
    assert f["mfu"] == pytest.approx(f["target_mfu"] + f["drafter_mfu"]) and f["mfu"] == pytest.approx(0.002)
    assert f["drafted_blocks_per_s"] == 75 and f["mfu_peak_tflops"] == 1000.0
    cpu = flops.efficiency_fields(target=6e12, drafter=2e12, blocks=300, steps=2, seconds=4.0, peak=None)
    assert cpu["mfu"] is None and cpu["target_mfu"] is None and cpu["step_flops"] == 4e12
    uncounted = flops.efficiency_fields(target=6e12, drafter=None, blocks=None, steps=2, seconds=4.0, peak=1000.0)
    assert uncounted["step_flops"] is None and uncounted["mfu"] is None and uncounted["drafted_blocks_per_s"] is None


def test_the_peak_is_the_override_or_none_on_a_cpu():
    assert flops.peak_tflops(torch.device("cpu")) is None
    assert flops.peak_tflops(torch.device("cpu"), 312.0) == 312.0
    assert dict(flops.PEAK_BF16_TFLOPS)["H200"] == flops.H200_BF16_DENSE_TFLOPS == 790.0


OWN_MODULES = {  # name: (architecture, its section, the own parts the formula counts, not 0)
    "dspark vanilla": ("dspark", {"markov_rank": 8}, {"target_logits", "markov", "confidence"}),
    "dspark gated, no confidence": ("dspark", {"markov_rank": 8, "markov_head_type": "gated", "confidence_head": False,
                                               "confidence_weight": 0.0}, {"target_logits", "markov"}),
    "dspark rnn": ("dspark", {"markov_rank": 8, "markov_head_type": "rnn"}, {"target_logits", "markov", "confidence"}),
    "domino": ("domino", {"gru_hidden_dim": 24, "emb_dim": 12}, {"gru", "correction"}),
    "dflash2": ("dflash2", {"selector_rank": 8, "selector_top_k": 4}, {"convolutions", "selector"}),
    "dflash2, every row": ("dflash2", {"selector_rank": 6, "selector_top_k": 8, "selector_rows": "all",
                                      "conv_kernel_size": 3, "conv_group_size": 8}, {"convolutions", "selector"}),
    "lilicorr conv": ("lilicorr", {"candidate_topk": 4, "head_hidden_size": 32, "head_num_layers": 1,
                                   "head_num_heads": 2, "factor_dim": 8, "conv": True},
                      {"lilicorr_candidates", "lilicorr_anchor_rows", "lilicorr_head", "lilicorr_conv"}),
    "lilicorr": ("lilicorr", {"candidate_topk": 4, "head_hidden_size": 32, "head_num_layers": 1, "head_num_heads": 2,
                              "factor_dim": 8}, {"lilicorr_candidates", "lilicorr_anchor_rows", "lilicorr_head"}),
    "lilicorr as wide as the drafter": ("lilicorr", {"candidate_topk": 2, "head_hidden_size": 0, "head_num_layers": 2,
                                                     "head_num_heads": 4, "factor_dim": 16, "mlp_ratio": 1.5},
                                        {"lilicorr_candidates", "lilicorr_anchor_rows", "lilicorr_head"}),
}


@pytest.mark.parametrize("case", list(OWN_MODULES))
def test_the_formula_counts_each_members_own_modules_that_run(case, monkeypatch):
    """Each member's step under the FLOP counter, every block kept and every slot of it run: the formula's
    DFlash core plus the architecture's own parts (its `Architecture.step_flops` hook) equal the matmuls that run, but for the
    fc's input gradient (as DFlash's) and, in Domino's GRU, the state gradient of each block's first step (its zero
    initial state needs none)."""
    arch, section, own = OWN_MODULES[case]
    if arch == "lilicorr":  # model FLOPs: its head's recompute in the backward (activation checkpointing) is not work
        from dflash_train.architectures.lilicorr import model as lilicorr_model
        monkeypatch.setattr(lilicorr_model, "checkpoint", lambda fn, *args, **_: fn(*args))
    torch.manual_seed(0)
    tcfg = Qwen3Config(hidden_size=H, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, vocab_size=300)
    model = AutoModelForCausalLM.from_config(tcfg).eval().requires_grad_(False)
    target = TargetCapture.from_model(model, LAYER_IDS)
    cfg = config_from_dict({"drafter": {"architecture": arch, "block_size": BS, "num_draft_layers": 2,
                                        "attention_backend": "sdpa"},
                            "objective": {"max_anchors": 6}, arch: section})
    drafter = architecture(arch).drafter_class(architecture(arch).config_for_run(tcfg, cfg, LAYER_IDS, 5))
    objective = architecture(arch).objective(drafter, target, resolve_backend("sdpa", torch.device("cpu"), BS), cfg,
                                             torch.float32)
    ids = torch.randint(10, 300, (2, 40), generator=torch.Generator().manual_seed(1))
    with FlopCounterMode(display=False) as counter:
        stats = objective(Batch(ids, torch.ones_like(ids), torch.tensor([40, 40])), torch.Generator().manual_seed(0))
        stats.loss.backward()
    counted = sum(counter.get_flop_counts()["Global"].values())
    work = stats.work
    assert work.blocks == 12 and work.block_tokens == 48  # every block kept: the modules run over its slots
    shape = flops.drafter_shape(drafter)
    parts = flops.drafter_flop_parts(shape, 80, work, 2, len(LAYER_IDS), flops.own_flops(drafter))
    assert {k for k in parts if k not in ("linears", "attention", "lm_head") and parts[k]} == own
    # DSpark and LiLiCorr read the final norm
    last = tcfg.num_hidden_layers - 1 if arch in ("dspark", "lilicorr") else max(LAYER_IDS)
    target_linears = flops.target_flop_parts(flops.model_shape(tcfg), [40, 40], last)["linears"]
    fc_input_gradient = 2 * 80 * len(LAYER_IDS) * H * H
    first_state_gradients = work.blocks * 2 * 3 * 24 * 24 if arch == "domino" else 0
    assert counted == target_linears + sum(parts.values()) - parts["attention"] - fc_input_gradient \
        - first_state_gradients
    if arch == "dspark":  # overlapping blocks read each target position once
        assert 0 < work.target_positions < work.counted_rows
        assert parts["target_logits"] == 2 * work.target_positions * H * 300
