"""The model FLOPs of a training step and its MFU: one accounting for the training loop's metrics
(train/loop/train_loop.py) and the throughput benchmarks (benchmarks/throughput.py), so that the two compare.

Useful FLOPs only (docs/results/performance.md), from sizes the host knows (no device read):
- the target's capture, forward only: the matmuls of the decoder layers it runs (up to the last captured
  layer, or every layer when the run reads the target's final hidden states), 2 FLOPs a weight a token (a
  mixture-of-experts layer: its router and the experts a token is routed to), and causal attention over the
  unmasked (query, key) pairs, 4 x heads x head_dim each;
- the drafter, forward + backward (3 x forward: input and weight gradients): the fc over the context tokens, per
  layer q/o and the MLP over the block tokens, k/v over context and block tokens, attention over the pairs a
  block's queries see (`architectures.stats.DraftWork`);
- the vocabulary head in the loss's chunks, over the counted rows: the target's frozen lm_head forward and
  input gradient (2 x), a trained draft-vocabulary head forward and both gradients (3 x; its backward forms the
  logits again, which counts as no useful FLOP);
- an architecture's own modules: its `Architecture.step_flops` hook (`architectures.contract.StepFlops`), from its
  drafter config, over the same host counts; an architecture counts there what its own modules compute and says
  what it leaves out (e.g. a second, gradient-free forward of products already counted).
Padding (past a row's length, blocks not kept) is computed but not counted.

MFU divides by a dense bf16 matmul peak: `PEAK_BF16_TFLOPS` by GPU name, `run.mfu_peak_tflops` to set it; none
on a CPU or an unknown GPU, where MFU is reported as null.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from ...architectures import architecture
from ...architectures.contract import Architecture, StepFlops
from ...architectures.stats import DraftWork
from ...target.hf_config import text_config

# The dense bf16 matmul peak measured on an H200 (benchmarks/throughput.py `matmul_peak_tflops`: the median
# 8192^3 bf16 matmul), what the benchmarks' MFU divides by (docs/results/performance.md).
H200_BF16_DENSE_TFLOPS = 790.0

# GPU name (a part of torch.cuda.get_device_name) -> dense bf16 matmul peak in TFLOP/s. The H100 SXM is the
# H200's chip at the same clocks (the H200 adds memory): taken as the same, not measured here. Other GPUs (an
# H100 PCIe or NVL runs lower clocks) report no MFU unless `run.mfu_peak_tflops` sets the peak.
PEAK_BF16_TFLOPS: tuple[tuple[str, float], ...] = (
    ("H200", H200_BF16_DENSE_TFLOPS),
    ("H100 80GB HBM3", H200_BF16_DENSE_TFLOPS),
    ("H100 SXM", H200_BF16_DENSE_TFLOPS),
)


def peak_tflops(device: torch.device, override: Optional[float] = None) -> Optional[float]:
    """The peak MFU divides by on `device`: `override` (run.mfu_peak_tflops) when given, else the table's entry for
    the GPU's name; None on a CPU or a GPU not in the table."""
    if override:
        return float(override)
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for part, peak in PEAK_BF16_TFLOPS if part in name), None)


# ------------------------------------------------------------------------------------------------ shapes
# A shape is a dict of a Hugging Face config's layer sizes: hidden_size, num_hidden_layers, num_attention_heads,
# num_key_value_heads, head_dim, intermediate_size, vocab_size; a mixture of experts adds num_experts,
# num_experts_per_tok and moe_intermediate_size; a drafter with its own head adds draft_vocab_size.


def model_shape(config: Any) -> dict:
    """The shape of a (possibly multimodal) Hugging Face config's text model."""
    t = text_config(config)
    heads = t.num_attention_heads
    shape = dict(hidden_size=t.hidden_size, num_hidden_layers=t.num_hidden_layers, num_attention_heads=heads,
                 num_key_value_heads=getattr(t, "num_key_value_heads", None) or heads,
                 head_dim=getattr(t, "head_dim", None) or t.hidden_size // heads,
                 intermediate_size=t.intermediate_size, vocab_size=t.vocab_size)
    experts = getattr(t, "num_experts", None) or getattr(t, "num_local_experts", None)
    if experts:  # Qwen-MoE names the expert width moe_intermediate_size, Mixtral intermediate_size
        shape.update(num_experts=experts, num_experts_per_tok=t.num_experts_per_tok,
                     moe_intermediate_size=getattr(t, "moe_intermediate_size", None) or t.intermediate_size)
    return shape


def layer_matmul_params(c: dict) -> int:
    """Matmul weights one token goes through in one layer: for a MoE layer the router and its active experts
    only (so the target's MFU counts active parameters, not the resident ones)."""
    h, nh, nkv, hd = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    attention = h * nh * hd * 2 + h * nkv * hd * 2
    if "num_experts" in c:
        return attention + h * c["num_experts"] + c["num_experts_per_tok"] * 3 * h * c["moe_intermediate_size"]
    return attention + 3 * h * c["intermediate_size"]


def layer_resident_params(c: dict) -> int:
    """Matmul weights one layer holds (every expert of a MoE layer): what a sharded target gathers per layer."""
    if "num_experts" not in c:
        return layer_matmul_params(c)
    h = c["hidden_size"]
    attention = layer_matmul_params({**c, "num_experts_per_tok": 0}) - h * c["num_experts"]
    return attention + h * c["num_experts"] + c["num_experts"] * 3 * h * c["moe_intermediate_size"]


# ------------------------------------------------------------------------------------------------ FLOPs


def target_flop_parts(c: dict, lengths: Sequence[int], last_layer: int) -> dict[str, float]:
    """The target capture's FLOPs over rows of `lengths` tokens through decoder layers 0..`last_layer`, by kind:
    `linears` (q/k/v/o and the MLP: FP8 with target.quantize=fp8) and `attention` (causal)."""
    layers = last_layer + 1
    per_token = 2 * layer_matmul_params(c) * layers
    attn = sum(4 * c["num_attention_heads"] * c["head_dim"] * (s * (s + 1) / 2) for s in lengths) * layers
    return {"linears": float(per_token * sum(lengths)), "attention": float(attn)}


def target_flops(c: dict, lengths: Sequence[int], last_layer: int) -> float:
    return sum(target_flop_parts(c, lengths, last_layer).values())


def drafter_flop_parts(c: dict, context_tokens: int, work: DraftWork, n_layers: int, captured_layers: int,
                       own: StepFlops = StepFlops()) -> dict[str, float]:
    """The drafter step's FLOPs (forward + backward) over `context_tokens` target positions (the rows' lengths
    summed) and the blocks of `work`, by kind: `linears` (fc, q/k/v/o, MLP: FP8 with drafter.fp8), `attention`,
    `lm_head` (the vocabulary head of the loss's chunks), then the parts of the architecture's own modules (`own`,
    `own_flops(drafter)`)."""
    h, nh, nkv, hd, i = (c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"],
                         c["intermediate_size"])
    s, q = context_tokens, work.block_tokens
    fc = 2 * s * captured_layers * h * h
    per_layer = 2 * q * (h * nh * hd * 2 + 3 * h * i) + 2 * (s + q) * h * nkv * hd * 2
    attention = 4 * nh * hd * work.attended * n_layers
    draft_vocab = c.get("draft_vocab_size")
    lm_head = 2 * work.counted_rows * h * (draft_vocab or c["vocab_size"]) * (3 if draft_vocab else 2)
    return {"linears": 3.0 * (fc + per_layer * n_layers), "attention": 3.0 * attention, "lm_head": float(lm_head),
            **own.parts(work)}


def drafter_flops(c: dict, context_tokens: int, work: DraftWork, n_layers: int, captured_layers: int,
                  own: StepFlops = StepFlops()) -> float:
    return sum(drafter_flop_parts(c, context_tokens, work, n_layers, captured_layers, own).values())


def drafter_shape(drafter) -> dict:
    """A drafter's shape (`model_shape` of its config, with its own head's vocabulary when it has one)."""
    shape = model_shape(drafter.config)
    if getattr(drafter, "draft_vocab_size", 0):
        shape["draft_vocab_size"] = drafter.draft_vocab_size
    return shape


def own_flops(drafter, arch: Optional[Architecture] = None) -> StepFlops:
    """The FLOPs of the drafter's own modules: its architecture's `step_flops` of its config (`arch`: the run's
    resolved architecture; without it, the one the drafter names)."""
    return (arch if arch is not None else architecture(drafter.architecture)).step_flops(drafter.config)


# ------------------------------------------------------------------------------------------------ the loop


@dataclass(frozen=True)
class StepAccounting:
    """What a rank's step costs, from its micro-batches' host sizes: the target's capture (None: this rank does not
    run it, a split placement's drafter rank) through `last_layer`, and the drafter of `drafter` shape with its
    architecture's own modules (`own`)."""

    target: Optional[dict]
    last_layer: int
    drafter: dict
    drafter_layers: int
    captured_layers: int
    own: StepFlops = StepFlops()

    @classmethod
    def of(cls, target_config: Any, layer_ids: Sequence[int], reads_final: bool, drafter,
           arch: Optional[Architecture] = None) -> "StepAccounting":
        """`target_config`: the target's HF config when this rank runs the capture, else None; `reads_final`: the
        captures run every layer (`architectures.reads_target_final`); `arch`: the run's architecture."""
        target = model_shape(target_config) if target_config is not None else None
        last = (target["num_hidden_layers"] - 1) if target is not None and reads_final else max(layer_ids)
        return cls(target, last, drafter_shape(drafter), len(drafter.layers), len(layer_ids), own_flops(drafter, arch))

    def step(self, lengths: Sequence[int], work: Optional[DraftWork]) -> tuple[float, Optional[float]]:
        """(target FLOPs, drafter FLOPs or None without host counts) of a step over rows of `lengths` tokens."""
        target = target_flops(self.target, lengths, self.last_layer) if self.target is not None else 0.0
        if work is None:
            return target, None
        return target, drafter_flops(self.drafter, sum(lengths), work, self.drafter_layers, self.captured_layers,
                                     self.own)


def efficiency_fields(target: float, drafter: Optional[float], blocks: Optional[int], steps: int, seconds: float,
                      peak: Optional[float]) -> dict[str, Any]:
    """The metrics record's efficiency fields over a window of `steps` steps that took `seconds`, with its
    `target` and `drafter` FLOPs and drafted `blocks` summed (None: not counted on this rank): FLOPs per step,
    MFU against `peak` TFLOP/s (None without one), drafted blocks per second. The loop times whole steps only,
    so `target_mfu` and `drafter_mfu` are each part's FLOPs over the step's time: they add up to `mfu`."""
    steps, seconds = max(steps, 1), max(seconds, 1e-9)
    total = None if drafter is None else target + drafter

    def mfu(flops: Optional[float]) -> Optional[float]:
        return None if flops is None or not peak else flops / seconds / (peak * 1e12)

    return {"target_flops": target / steps, "drafter_flops": None if drafter is None else drafter / steps,
            "step_flops": None if total is None else total / steps,
            "target_mfu": mfu(target), "drafter_mfu": mfu(drafter), "mfu": mfu(total), "mfu_peak_tflops": peak,
            "drafted_blocks": blocks, "drafted_blocks_per_s": None if blocks is None else blocks / seconds}
