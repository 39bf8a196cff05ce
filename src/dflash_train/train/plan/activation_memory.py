"""How much activation memory one micro-batch needs, from the config alone (before any weights load): the target's
capture and the drafter's training step, at the largest micro-batch the data keys allow. An upper-bound model of
named terms (`capture_parts`, `drafter_step_parts`), checked against the live tensors of real eager steps on CPU
(tests/unit/train/test_activation_memory.py). Compiled drafter layers save less than the eager ones counted here (inductor
recomputes the norms and SiLU in backward), so on a GPU with `drafter.compile` the bound is loose by up to ~20%."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from ...architectures import architecture, reads_target_final
from ...architectures.contract import Architecture, StepMemory
from ...config.schema import Config
from ...target.hf_config import text_config
from ...architectures.family.blocks import blocks_for

_F32 = 4
FLEX_TILE = 128  # architectures/family/backend.py: flex tiles whole query blocks and pads the context to tiles
TRANSPORT_DEPTH = 2  # transport.TargetOutbox's sends in flight


@dataclass(frozen=True)
class MicroBatchShape:
    """One micro-batch: `rows` sequences padded to `context` tokens, `blocks` blocks a row of `block_size`."""

    rows: int
    context: int
    blocks: int
    block_size: int

    @property
    def tokens(self) -> int:
        return self.rows * self.context

    @property
    def queries(self) -> int:
        """The drafter's query tokens: every block's slots."""
        return self.rows * self.blocks * self.block_size

    @property
    def counted(self) -> int:
        """The most counted rows (slot 0 of a block never counts): the lm_head + CE's rows."""
        return self.rows * self.blocks * (self.block_size - 1)

    def describe(self) -> str:
        return f"{self.rows} x {self.context} tokens, {self.blocks} blocks a row"


def largest_micro_batches(cfg: Config, multiple_of: int, bs: int) -> list[MicroBatchShape]:
    """For each row count the batching allows (1..data.max_batch_size), the largest micro-batch of it: rows as long
    as data.max_length and data.token_budget let them be (padding included), with as many blocks of `bs` (the
    drafter's block size) a row as `sample_anchors` gives such a row (objective.max_anchors, max_anchors_per_batch,
    rounded to `multiple_of`)."""
    d, o = cfg.data, cfg.objective
    shapes = []
    for rows in range(1, d.max_batch_size + 1):
        context = min(d.max_length, d.token_budget // rows)
        if context < bs:
            break
        blocks = int(blocks_for(np.array([rows]), np.array([context - bs + 1]), o.max_anchors, o.max_anchors_per_batch,
                                multiple_of)[0])
        shapes.append(MicroBatchShape(rows, context, blocks, bs))
    return shapes


def _dims(config) -> tuple[int, int, int, int]:
    """(hidden, query width nh*hd, key/value width nkv*hd, dense MLP width) of a decoder config."""
    h, nh = config.hidden_size, config.num_attention_heads
    hd = getattr(config, "head_dim", None) or h // nh
    nkv = getattr(config, "num_key_value_heads", None) or nh
    return h, nh * hd, nkv * hd, config.intermediate_size


def target_layer_transient(config, tokens: int, dtype_bytes: int) -> int:
    """Bytes one decoder layer of the target holds at once under no_grad, beyond its input: the residual and its
    normed copy (with the norm's float32 statistics pass), q/k/v through their norms and RoPE (about four copies of
    each while RoPE runs; k/v at the query heads' width, as a repeat_kv would make them), the attention output and
    its contiguous copy, and the MLP's gate, activation and up at the intermediate size (3 x I; the product lands
    as the gate is freed). A MoE layer (`num_experts`): per token and routed expert, the gathered input, the fused
    gate/up, the activation and product, the down output and its weighted copy (grouped_mm's path), plus the router's
    logits and float32 probabilities and the eager path's int64 one-hot mask: the larger of a dense and a MoE layer."""
    h, q, kv, inter = _dims(config)
    attention = 3 * h + 4 * q + 4 * max(kv, q) + 2 * q
    dense = 3 * h + 3 * inter
    per_token = max(attention, dense) * dtype_bytes + 2 * h * _F32
    experts = getattr(config, "num_experts", 0) or getattr(config, "num_local_experts", 0) or 0
    if experts:
        k, moe_inter = config.num_experts_per_tok, config.moe_intermediate_size
        moe = (3 * h + k * (3 * h + 4 * moe_inter)) * dtype_bytes + experts * (dtype_bytes + _F32) + 8 * k * (experts + 1)
        per_token = max(per_token, moe + 2 * h * _F32)
    return tokens * per_token


def capture_parts(target_config, layer_ids: list[int], shape: MicroBatchShape, dtype_bytes: int,
                  with_final: bool = False) -> dict[str, int]:
    """The target capture's peak (target/capture.py: no_grad, layers up to the last captured one): the K captured
    layer outputs kept `[tokens, K*H]` and, at the end, their concatenated copy (`captured states` counts the kept
    ones, `capture concatenation` the copy, which peaks alone: the layer transients are gone by then, so the larger of
    the copy and one layer's transient with K-1 captured so far); RoPE tables; with distillation the final normed state."""
    tc = text_config(target_config)
    t, h, k = shape.tokens, tc.hidden_size, len(layer_ids)
    hd = getattr(tc, "head_dim", None) or h // tc.num_attention_heads
    layer = target_layer_transient(tc, t, dtype_bytes) + (k - 1) * t * h * dtype_bytes
    parts = {"captured states": k * t * h * dtype_bytes,
             "capture transient": max(layer - k * t * h * dtype_bytes, k * t * h * dtype_bytes),
             "rope tables": t * hd * (2 * dtype_bytes + 3 * _F32)}
    if with_final:
        parts["final hidden states"] = t * h * dtype_bytes
    return parts


@dataclass(frozen=True)
class DrafterStepSettings:
    """What shapes the drafter step's memory besides the micro-batch (from the run's keys)."""

    compute_bytes: int  # run.dtype's bytes (bfloat16 2, float32 4)
    target_bytes: int  # the captured states' dtype (target.dtype)
    captured_layers: int
    head_classes: int  # the lm_head's rows: the target's vocabulary or drafter.draft_vocab_size
    loss_chunk: int  # objective.loss_chunk_size
    backend: str  # "flex" or "sdpa"
    compiled_loss: bool  # on a GPU the CE chunk compiles (one fused pass); eager elsewhere
    own: StepMemory = StepMemory()  # the architecture's own terms (`Architecture.step_memory`)
    distill: bool = False
    transformed: bool = False  # output_multiplier != 1 or a softcap
    trainable_params: int = 0  # autocast keeps a compute-dtype copy of each (when compute_bytes < 4)
    own_head: bool = False  # drafter.draft_vocab_size > 0: the drafter's own (float32 master) lm_head
    kept_head_gradient: bool = False  # Config.keeps_head_gradient: the forward's [counted, classes] gradient rows


KEPT_HEAD_GRADIENT = "kept head gradient rows"  # the name of that part (preflight's remedy names its key)


def _ce_chunk_bytes(s: DrafterStepSettings, rows: int) -> int:
    """One lm_head + CE chunk `[rows, classes]` (architectures/family/loss.py): the previous chunk's gradient (still
    referenced while the next chunk's logits form), the logits, and the chunk math: compiled (a GPU), one fused
    kernel writing the gradient; eager, the float32 copy of the logits, their shifted copy and its exp live together.
    More for distillation (the target's logits and its softmax), a score transform (float32 copies) and the
    architecture's own (`StepMemory.ce_chunk_per_class`)."""
    e = s.compute_bytes
    per = 3 * e if s.compiled_loss else 2 * e + (_F32 if e < _F32 else 0) + 2 * _F32
    if s.distill:
        per += e + (_F32 if s.compiled_loss else 8 * _F32)
    if s.transformed:
        per += 6 * _F32
    per += s.own.ce_chunk_per_class(e, s.compiled_loss)
    return rows * s.head_classes * per


def drafter_layer_saved(drafter_config, queries: int, context: int, e: int, own: StepMemory = StepMemory()) -> int:
    """What one drafter layer saves for its backward (architectures/family/layers.py, eager): per query token the
    residual and normed input of both sublayers (4 H), q before its norm and after RoPE, the attention output, its
    masked copy and o_proj's contiguous input (5 nh*hd), the block's k before its norm (nkv*hd), the MLP's gate, SiLU,
    up and product (4 I); per context token k before its norm; per key (context + block) the concatenated k and v.
    The architecture's own modules add `own.layer_per_query` per query token."""
    h, q, kv, inter = _dims(drafter_config)
    per_query = 4 * h + 5 * q + kv + 4 * inter + own.layer_per_query(h)
    return (queries * per_query + context * kv + (context + queries) * 2 * kv) * e


def _head_copy(s: DrafterStepSettings, hidden: int) -> int:
    """The lm_head weight in the compute dtype, which the loss casts once when it is held in another (a float32
    target's head under bfloat16 compute; a reduced draft vocabulary's float32 master head), or joins with an
    architecture's own columns (`StepMemory.head_columns`) whatever its dtype."""
    held_bytes = _F32 if s.own_head else s.target_bytes
    if held_bytes != s.compute_bytes or s.own.head_columns():
        return s.head_classes * (hidden + s.own.head_columns()) * s.compute_bytes
    return 0


def drafter_step_parts(drafter_config, shape: MicroBatchShape, s: DrafterStepSettings) -> dict[str, int]:
    """The drafter training step's peak beyond its weights, gradients and optimizer state (train/loop/step.py and the
    algorithm's objective, eager): every layer's saved activations (`drafter_layer_saved`) over the query tokens
    (rows x blocks x block_size) and the context (rows x context, padded to whole flex tiles), the context the
    captured states are projected to (fc output and its norm), the block embeddings' layer input and the final
    norm's rows, RoPE tables and masks, then the larger of the two things that run on top of all of that: the
    lm_head + CE's chunk (`_ce_chunk_bytes`) with the gradient rows the loss keeps `[counted, H]`, or the backward of
    one layer (gradients of its activations, about one layer's saved size), or one of the architecture's own
    (`StepMemory.on_top`). With a compute dtype narrower than float32, autocast's copies of the trainable weights
    are held too."""
    e = s.compute_bytes
    h = drafter_config.hidden_size
    _, qw, kv, _ = _dims(drafter_config)
    context = -(-shape.context // FLEX_TILE) * FLEX_TILE if s.backend == "flex" else shape.context
    ctx_tokens, queries, counted = shape.rows * context, shape.queries, shape.counted
    layers = drafter_config.num_hidden_layers
    one_layer = drafter_layer_saved(drafter_config, queries, ctx_tokens, e, s.own)
    parts = {"drafter layers": layers * one_layer,
             "drafter context": ctx_tokens * h * 2 * e + (ctx_tokens * s.captured_layers * h * s.target_bytes
                                                          if s.backend == "flex" else 0),
             "drafter ends": (queries * 3 * h + counted * h) * e + (ctx_tokens + queries) * (hd_bytes(drafter_config, e) + 8)}
    if s.backend == "sdpa":  # dense boolean masks [rows, 1, Q, context + Q]: the layout's and one per layer (| dead)
        per_row_q = shape.blocks * shape.block_size
        parts["dense masks"] = shape.rows * per_row_q * (shape.context + per_row_q) * (1 + layers)
    on_top = {"lm_head + CE chunk": _ce_chunk_bytes(s, min(s.loss_chunk, counted)) + _head_copy(s, h),
              "one layer's backward": one_layer, **s.own.on_top(counted, s.head_classes, e)}
    name = max(on_top, key=on_top.get)
    parts[name] = on_top[name]
    parts["loss rows"] = counted * (h * e + 4 * _F32) + s.own.loss_rows(counted, e)
    if s.kept_head_gradient:
        parts[KEPT_HEAD_GRADIENT] = counted * s.head_classes * e
    if e < _F32:
        parts["autocast weight copies"] = s.trainable_params * e
    return parts


def hd_bytes(drafter_config, e: int) -> int:
    """RoPE's cos and sin per position `[head_dim]` each, in the compute dtype, and their float32 angles."""
    h, nh = drafter_config.hidden_size, drafter_config.num_attention_heads
    hd = getattr(drafter_config, "head_dim", None) or h // nh
    return 2 * hd * e + 3 * hd * _F32


@dataclass(frozen=True)
class ActivationEstimate:
    """The named parts (bytes) of one rank's activation peak, at the micro-batch shape that gives it."""

    parts: dict[str, int]
    shape: Optional[MicroBatchShape]

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    def describe(self) -> str:
        if not self.parts:
            return "no activations"
        named = ", ".join(f"{name} {n / 2**30:.1f}" for name, n in sorted(self.parts.items(), key=lambda kv: -kv[1]))
        return f"{self.total / 2**30:.1f} GiB ({named}; at {self.shape.describe()})"


def step_settings(cfg: Config, target_config, drafter_config, layer_ids: list[int], target_dtype: torch.dtype,
                  compute_dtype: torch.dtype, device_type: str, trainable_params: int,
                  arch: Architecture) -> DrafterStepSettings:
    """The drafter step's settings of this run (the attention backend as `resolve_backend` picks it; `arch`: the
    run's architecture)."""
    d, o = cfg.drafter, cfg.objective
    backend = "flex" if device_type == "cuda" and d.attention_backend in ("auto", "flex") else "sdpa"
    return DrafterStepSettings(
        compute_bytes=torch.empty((), dtype=compute_dtype).element_size(),
        target_bytes=torch.empty((), dtype=target_dtype).element_size(),
        captured_layers=len(layer_ids),
        head_classes=d.draft_vocab_size or text_config(target_config).vocab_size,
        loss_chunk=o.loss_chunk_size, backend=backend, compiled_loss=device_type == "cuda",
        own=arch.step_memory(drafter_config),
        distill=reads_target_final(cfg, arch),
        transformed=d.output_multiplier != 1.0 or bool(d.final_logit_softcapping),
        trainable_params=trainable_params, own_head=d.draft_vocab_size > 0,
        kept_head_gradient=cfg.keeps_head_gradient)


def activation_estimate(role: str, cfg: Config, target_config, drafter_config, layer_ids: list[int],
                        target_dtype: torch.dtype, compute_dtype: torch.dtype, device_type: str = "cuda",
                        trainable_params: int = 0, *, arch: Optional[Architecture] = None) -> ActivationEstimate:
    """The activation peak of a rank of `role`, at the worst of the largest micro-batches (`largest_micro_batches`):

    - `target` (split placement): the capture (`capture_parts`) plus the transport's send buffers (`token_budget`
      x K*H each, `TRANSPORT_DEPTH` in flight and one filling);
    - `drafter` (split): the step (`drafter_step_parts`) plus the receive buffers of this step's micro-batches and
      of the next step's, asked for ahead (2 x optim.grad_accum);
    - `colocated`: the larger of the capture and the step with the captured states it feeds (and, distilling, the
      target's final states and their rows).

    Weights, gradients and optimizer state are not in it (preflight.needed_bytes counts those). `arch`: the run's
    architecture (the preflight passes the one the start resolved; without it, `drafter.architecture`'s)."""
    arch = arch if arch is not None else architecture(cfg.drafter.architecture)
    s = step_settings(cfg, target_config, drafter_config, layer_ids, target_dtype, compute_dtype, device_type,
                      trainable_params, arch)
    bs = drafter_config.block_size
    multiple = max(FLEX_TILE // bs, 1) if s.backend == "flex" else 1
    h = text_config(target_config).hidden_size
    message = cfg.data.token_budget * len(layer_ids) * h * s.target_bytes
    best = ActivationEstimate({}, None)
    for shape in largest_micro_batches(cfg, multiple, bs):
        capture = capture_parts(target_config, layer_ids, shape, s.target_bytes, with_final=s.distill)
        if role == "target":
            parts = {**capture, "transport buffers": (TRANSPORT_DEPTH + 1) * message}
        else:
            parts = drafter_step_parts(drafter_config, shape, s)
            if role == "drafter":
                parts["received states"] = 2 * cfg.optim.grad_accum * message
            else:
                parts["captured states"] = capture["captured states"]
                if s.distill:
                    parts["final hidden states"] = capture["final hidden states"] + shape.counted * h * s.target_bytes
                if sum(capture.values()) > sum(parts.values()):
                    parts = capture
        if sum(parts.values()) > best.total:
            best = ActivationEstimate(parts, shape)
    return best
