"""What the generic stack (trainer, validation, evaluation, export) needs from a drafter architecture.

An architecture is a package under `algorithms/` that provides an `Architecture`: its drafter class, how
to derive the drafter's config from the target's and read it back from an exported config.json, the
reference-format config it exports, its attention backend, and its training objective. The generic code
never imports an architecture's package; it asks the registry (`algorithms.architecture(name)`).
"""

from __future__ import annotations

import abc
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, NamedTuple, Optional, Protocol

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from ..config.schema import Config
    from ..data.batch import Batch


@dataclass(frozen=True)
class DraftWork:
    """The sizes of a micro-batch's drafter work, counted on the host where its blocks were planned (no device
    read): the drafter's side of the FLOP accounting (train/flops.py). Counts add up over micro-batches."""

    blocks: int = 0  # kept blocks (the drafted blocks)
    block_tokens: int = 0  # their query positions: blocks x block size
    attended: int = 0  # (query, key) pairs of their attention: each query sees the context before its anchor and
    # its own block (full attention; a sliding-window or in-block causal layer sees fewer)
    counted_rows: int = 0  # rows through the vocabulary head and the loss
    # target positions whose logits the loss forms, each once (a loss term against the target's distribution that
    # reads each position's logits once, however many rows share it; 0 where the loss forms none)
    target_positions: int = 0

    @staticmethod
    def of(anchors: torch.Tensor, keep: torch.Tensor, block_size: int, counted_rows: int) -> "DraftWork":
        """From host `anchors` / `keep` `[B, N]` (not-kept blocks count nothing)."""
        kept = int(keep.sum())
        before_anchor = int((anchors * keep).sum())
        return DraftWork(kept, kept * block_size, (before_anchor + kept * block_size) * block_size, int(counted_rows))

    def __add__(self, other: "DraftWork") -> "DraftWork":
        return DraftWork(self.blocks + other.blocks, self.block_tokens + other.block_tokens,
                         self.attended + other.attended, self.counted_rows + other.counted_rows,
                         self.target_positions + other.target_positions)


@dataclass
class StepStats:
    """Sums over a micro-batch or a step (tensors on the device: read them only when logging)."""

    loss: torch.Tensor
    correct_per_slot: torch.Tensor  # [bs] counted slots predicted right
    counted_per_slot: torch.Tensor  # [bs] counted slots
    accepted_sum: torch.Tensor  # sum over kept blocks of the acceptance-length estimate
    kept_blocks: torch.Tensor
    grad_norm: torch.Tensor | None = None
    # An architecture's own metrics: `*_loss` values (averaged over micro-batches, logged as they are) and
    # counts of counted slots (summed, logged as a share of the counted slots), e.g. an extra module's own loss.
    extra: dict[str, torch.Tensor] = field(default_factory=dict)
    # Host counts of the drafter's work (`DraftWork`); None where the blocks were planned on the device.
    work: Optional[DraftWork] = None

    @staticmethod
    def sum(parts: "list[StepStats]") -> "StepStats":
        """Counts add up over micro-batches; the losses are their mean."""
        extra = {k: (torch.stack([p.extra[k] for p in parts]).mean() if k.endswith("_loss")
                     else sum(p.extra[k] for p in parts)) for k in parts[0].extra}
        works = [p.work for p in parts]
        return StepStats(
            loss=torch.stack([p.loss for p in parts]).mean(),
            correct_per_slot=sum(p.correct_per_slot for p in parts),
            counted_per_slot=sum(p.counted_per_slot for p in parts),
            accepted_sum=sum(p.accepted_sum for p in parts),
            kept_blocks=sum(p.kept_blocks for p in parts),
            extra=extra,
            work=None if None in works else sum(works[1:], works[0]),
        )


def acceptance_estimate(correct: torch.Tensor) -> torch.Tensor:
    """`[..., bs]` correctness of slots 1..bs-1 (slot 0 ignored) -> `1 + leading run of correct slots`."""
    return 1 + correct[..., 1:].long().cumprod(-1).sum(-1)


def default_target_layer_ids(num_target_layers: int, num_ids: int) -> list[int]:
    """The reference rule: one id -> the middle layer; else evenly from layer 1 to L - 3."""
    if num_ids == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    return [int(round(start + i * (end - start) / (num_ids - 1))) for i in range(num_ids)]


# An attention function: (q [b, nh, Q, d], k [b, nkv, KV, d], v, mask) -> [b, nh, Q, d].
AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, object], torch.Tensor]


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
    """Dense attention with an optional boolean mask `[b, 1, Q, KV]`; rows with no visible key give 0."""
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=q.shape[1] != k.shape[1])
    # A row with no visible key (a not-kept block) is NaN in some kernels, and NaN poisons the
    # backward. Let such rows see every key, then zero their output: no gradient flows through them.
    dead = ~mask.any(-1, keepdim=True)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask | dead, enable_gqa=q.shape[1] != k.shape[1])
    return out.masked_fill(dead, 0.0)


class DrafterKVCache:
    """Per-layer key/value cache for speculative decoding; `crop` drops rejected positions."""

    def __init__(self, num_layers: int):
        self.keys: list[Optional[torch.Tensor]] = [None] * num_layers
        self.values: list[Optional[torch.Tensor]] = [None] * num_layers

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.keys[layer] is not None:
            k = torch.cat([self.keys[layer], k], dim=2)
            v = torch.cat([self.values[layer], v], dim=2)
        self.keys[layer], self.values[layer] = k, v
        return k, v

    def length(self) -> int:
        return 0 if self.keys[0] is None else self.keys[0].shape[2]

    def crop(self, length: int) -> None:
        for i, k in enumerate(self.keys):
            if k is not None:
                self.keys[i] = k[:, :, :length]
                self.values[i] = self.values[i][:, :, :length]


# ---------------------------------------------------------------------------- reference config fields
# Newer reference drafters (z-lab/dflash) carry six fields that change what decoding
# computes. `draft_value` reads the three output/input fields the reference way; `layer_kinds` reads the
# three attention fields, which the reference reads from the top level of config.json only.


def draft_value(config: Any, name: str, default: Any) -> Any:
    """`config.dflash_config[name]` when that key is present, else the top-level `config.name`, else
    `default` (the reference's `_draft_value`). A null value reads as `default`."""
    dflash = getattr(config, "dflash_config", None) or {}
    value = dflash[name] if name in dflash else getattr(config, name, None)
    return default if value is None else value


def _number(config: Any, name: str, default: float) -> float:
    value = draft_value(config, name, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        where = "dflash_config." + name if name in (getattr(config, "dflash_config", None) or {}) else name
        raise ValueError(f"drafter config key '{where}' must be a finite number (got {value!r})")
    return float(value)


@dataclass(frozen=True)
class OutputFields:
    """What turns the drafter's final hidden states into scores, and what scales its block inputs:
    `logits = lm_head(h) * output_multiplier`, then `cap * tanh(logits / cap)` when the cap is set;
    block input embeddings (anchor and mask tokens, never the context features) `* input_embedding_scale`."""

    output_multiplier: float = 1.0
    final_logit_softcapping: Optional[float] = None  # None = off (a file's 0 or null reads as off)
    input_embedding_scale: float = 1.0

    @staticmethod
    def of(config: Any) -> "OutputFields":
        """Read from `dflash_config` first, then the top level, then the defaults; refuses non-numbers."""
        cap = _number(config, "final_logit_softcapping", 0.0)
        if cap < 0:
            raise ValueError(f"drafter config key 'final_logit_softcapping' must be >= 0 (0 or null = off; got {cap})")
        return OutputFields(_number(config, "output_multiplier", 1.0), cap or None,
                            _number(config, "input_embedding_scale", 1.0))


def transform_logits(logits: torch.Tensor, multiplier: float = 1.0, softcap: Optional[float] = None) -> torch.Tensor:
    """`logits * multiplier`, then `softcap * tanh(x / softcap)` when `softcap` (the reference's order)."""
    if multiplier != 1.0:
        logits = logits * multiplier
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    return logits


def draft_vocab_size_of(config: Any) -> int:
    """The top-level `draft_vocab_size` of a drafter config (vLLM's reduced draft vocabulary): 0 when absent or
    null (the target's vocabulary, through the target's lm_head), else an integer in 1..vocab_size."""
    n = getattr(config, "draft_vocab_size", None)
    if n is None:
        return 0
    vocab = getattr(config, "vocab_size", None)
    if isinstance(n, bool) or not isinstance(n, int) or n < 1 or (isinstance(vocab, int) and n > vocab):
        raise ValueError(f"drafter config key 'draft_vocab_size' must be an integer in 1..vocab_size ({vocab}), or "
                         f"absent for the target's vocabulary (got {n!r})")
    return n


def target_to_draft(d2t: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """`[vocab_size]` long: the draft id of each target token, -1 for a token outside the draft vocabulary
    (from the offsets `d2t`: target id = draft id + d2t[draft id])."""
    draft_ids = torch.arange(d2t.shape[0], device=d2t.device)
    out = torch.full((vocab_size,), -1, dtype=torch.long, device=d2t.device)
    return out.index_put_((draft_ids + d2t,), draft_ids)


@dataclass(frozen=True)
class AttentionKind:
    """How one drafter layer attends (masks are built once per forward for each distinct kind).

    Positions are absolute (the context included). A query at position q sees a key at position k when
    the layout allows it (context before the block's anchor, its own block) and, with `sliding_window` W,
    `q - k < W` (strict: distance 0..W-1 back), also `k - q < W` when not causal (a symmetric window);
    `causal` makes attention inside the block causal (k <= q). The default kind, full and non-causal, is
    DFlash's original attention: the layout alone."""

    sliding_window: Optional[int] = None
    causal: bool = False

    @property
    def is_default(self) -> bool:
        return self.sliding_window is None and not self.causal


FULL_ATTENTION = AttentionKind()
_LAYER_TYPES = ("full_attention", "sliding_attention")


def layer_kinds(config: Any) -> list[AttentionKind]:
    """Each layer's `AttentionKind`, read the reference way from the TOP LEVEL of the config: `layer_types`
    (absent: all `full_attention`), `sliding_window` (the window of the sliding layers) and `is_causal`
    (absent: causal iff the layer is sliding; set: that value for every layer)."""
    n = int(config.num_hidden_layers)
    types_ = getattr(config, "layer_types", None) or ["full_attention"] * n
    if len(types_) != n or any(t not in _LAYER_TYPES for t in types_):
        raise ValueError(f"drafter config key 'layer_types' must list {n} entries (num_hidden_layers), each one of "
                         f"{', '.join(_LAYER_TYPES)} (got {types_!r})")
    causal = getattr(config, "is_causal", None)
    if causal is not None and not isinstance(causal, bool):
        raise ValueError(f"drafter config key 'is_causal' must be true, false or absent (got {causal!r})")
    window = getattr(config, "sliding_window", None)
    if "sliding_attention" in types_ and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"drafter config key 'sliding_window' must be an integer >= 1: layer_types names "
                         f"sliding_attention layers (got {window!r})")
    kinds = []
    for t in types_:
        sliding = t == "sliding_attention"
        kinds.append(AttentionKind(window if sliding else None, sliding if causal is None else causal))
    return kinds


class BlockProposals(NamedTuple):
    """A drafter's greedy proposals for `n` blocks (`Drafter.greedy_proposals`): drafts `[n, D]`, the DDTree
    candidates' log-probabilities (`[n, D, k]` or `[n, D, k, k]`) and target ids `[n, D, k]` when asked for, and
    each draft's predicted acceptance `[n, D]` from a drafter with a confidence head."""

    drafts: torch.Tensor
    top_lp: Optional[torch.Tensor] = None
    top_ids: Optional[torch.Tensor] = None
    confidence: Optional[torch.Tensor] = None


class Drafter(nn.Module, metaclass=abc.ABCMeta):
    """The attributes generic code reads off any architecture's drafter (set by its constructor):
    `config` (the exported config), `block_size`, `mask_token_id`, `target_layer_ids`, `layers` (for a KV
    cache per layer) and `layers_compiled`. Its forward maps (target features `[b, S, K*H]`, block
    embeddings `[b, Q, H]`, position ids `[b, S + Q]`, attention fn, mask[, cache]) to the block's final
    hidden states `[b, Q, H]`; `logits` turns those into the vocabulary scores decoding ranks."""

    architecture: str  # its `drafter.architecture` name (the registry's key)
    config: Any
    block_size: int
    mask_token_id: int
    target_layer_ids: list[int]
    layers: nn.ModuleList
    # The six reference fields (`read_reference_fields` sets them from the config; these are the defaults).
    output_fields: OutputFields = OutputFields()
    layer_attention: list[AttentionKind]  # one per layer

    def read_reference_fields(self, config: Any) -> None:
        """Set `output_fields` and `layer_attention` from `config` (call in the constructor, before building layers)."""
        self.output_fields = OutputFields.of(config)
        self.layer_attention = layer_kinds(config)

    @property
    def output_multiplier(self) -> float:
        return self.output_fields.output_multiplier

    @property
    def final_logit_softcapping(self) -> Optional[float]:
        return self.output_fields.final_logit_softcapping

    @property
    def input_embedding_scale(self) -> float:
        return self.output_fields.input_embedding_scale

    @property
    def attention_kinds(self) -> list[AttentionKind]:
        """The distinct kinds of the layers, in layer order: one mask each per forward."""
        return list(dict.fromkeys(getattr(self, "layer_attention", None) or [FULL_ATTENTION]))

    @property
    def needs_masks(self) -> bool:
        """Whether some layer needs a mask beyond the layout (a window or in-block causality): then even
        decoding with a KV cache, whose layout needs none, must pass masks."""
        return any(not k.is_default for k in self.attention_kinds)

    def layer_masks(self, build: Callable[[AttentionKind], object]) -> dict[AttentionKind, object]:
        """`{kind: build(kind)}` for each distinct layer kind: what `forward`'s `mask` takes."""
        return {kind: build(kind) for kind in self.attention_kinds}

    def mask_of_layer(self, mask: object, layer: int) -> object:
        """Layer `layer`'s mask from `forward`'s `mask`: None (every key visible, for every layer), a mapping
        by `AttentionKind` (`layer_masks`), or one mask for all layers, which only a drafter whose layers are
        all of the default kind accepts (one built for another kind would silently drop a window)."""
        if mask is None:
            return None
        kinds = getattr(self, "layer_attention", None) or [FULL_ATTENTION] * len(self.layers)
        if isinstance(mask, Mapping):
            if kinds[layer] not in mask:
                raise ValueError(f"no mask for drafter layer {layer} ({kinds[layer]}); the masks given are for "
                                 f"{list(mask)}: build them with drafter.layer_masks")
            return mask[kinds[layer]]
        if not kinds[layer].is_default:
            raise ValueError(f"drafter layer {layer} attends as {kinds[layer]}: pass masks by kind "
                             "(drafter.layer_masks), not one mask for every layer")
        return mask

    @property
    def layers_compiled(self) -> bool:
        return False

    @abc.abstractmethod
    def dense_mask(self, anchors: torch.Tensor, keep: torch.Tensor, context_len: int,
                   kind: AttentionKind = FULL_ATTENTION) -> torch.Tensor:
        """The training layout's boolean mask `[b, 1, N*bs, S + N*bs]` for blocks at `anchors` `[b, N]`,
        for layers of `kind` (each architecture's, from its mask predicate)."""

    def dense_masks(self, anchors: torch.Tensor, keep: torch.Tensor, context_len: int) -> dict[AttentionKind, torch.Tensor]:
        """`dense_mask` for every layer kind (what `forward`'s `mask` takes)."""
        return self.layer_masks(lambda kind: self.dense_mask(anchors, keep, context_len, kind))

    @abc.abstractmethod
    def decode_masks(self, context_len: int, block_size: int, device: torch.device) -> Optional[dict]:
        """Masks for decoding with a KV cache (keys: the `context_len` positions before the block, then the
        block of `block_size` at position `context_len`): None when no layer needs one (each architecture's:
        `DFlashDrafter.decode_masks`)."""

    def embed_block(self, embed: Callable[[torch.Tensor], torch.Tensor], block_ids: torch.Tensor) -> torch.Tensor:
        """The block's input embeddings (anchor and mask tokens), through the target's embedding `embed`,
        times `input_embedding_scale`. Every path that forms block inputs (training, decoding, replay) calls
        this, so they agree."""
        out = embed(block_ids)
        scale = self.input_embedding_scale
        return out if scale == 1.0 else out * scale

    # ------------------------------------------------------------ the drafter's vocabulary
    # With a reduced draft vocabulary (`draft_vocab_size` N > 0) the drafter owns `lm_head` [N, H] and the buffer
    # `d2t` [N] (target id = draft id + d2t[draft id]); its scores are over draft ids, and what leaves the drafter
    # (drafts, tree candidates, sampling distributions) is mapped back to target ids here, so decoding, replay
    # and validation see target tokens only.

    @property
    def draft_vocab_size(self) -> int:
        """0: the target's vocabulary through the target's lm_head; N: the drafter's own head over N tokens."""
        head = self._modules.get("lm_head")
        return 0 if head is None else head.out_features

    def vocabulary_head(self, lm_head: nn.Module) -> nn.Module:
        """The head that scores the drafter's vocabulary: its own with a reduced vocabulary, else `lm_head`."""
        head = self._modules.get("lm_head")
        return lm_head if head is None else head

    def target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft ids -> target ids (the identity without a reduced vocabulary)."""
        if not self.draft_vocab_size:
            return draft_ids
        return draft_ids + self.d2t[draft_ids]

    def vocabulary_ids(self) -> torch.Tensor:
        """The target ids of the draft vocabulary, by draft id (`[N]`; needs a reduced vocabulary)."""
        return self.target_ids(torch.arange(self.draft_vocab_size, device=self.d2t.device))

    def logits(self, hidden: torch.Tensor, lm_head: nn.Module) -> torch.Tensor:
        """Scores (float32) of the block's final hidden states over the drafter's vocabulary: through the
        target's `lm_head` (target ids), or the drafter's own head (draft ids, with a reduced vocabulary):
        `head(h) * output_multiplier`, then the softcap."""
        head = self.vocabulary_head(lm_head)
        out = head(hidden.to(head.weight.dtype)).float()
        return transform_logits(out, self.output_multiplier, self.final_logit_softcapping)

    def num_drafts(self, block_size: Optional[int] = None) -> int:
        """Tokens one block of `block_size` slots (the trained block size by default) drafts: the number of
        speculative tokens a serving engine must be set to, and what `draft` returns per block. Slot 0 reads the
        anchor and the other slots are drafts here (DFlash: bs - 1); an architecture whose anchor slot predicts
        too (the anchor as the first prediction) drafts bs."""
        return (block_size or self.block_size) - 1

    @property
    def has_confidence(self) -> bool:
        """Whether the drafter predicts each draft's acceptance (`draft_with_confidence`), which decoding can use
        to verify fewer drafts (`eval --confidence-threshold`)."""
        return False

    def draft_with_confidence(self, hidden: torch.Tensor, lm_head: nn.Module, anchor_ids: torch.Tensor,
                              temperature: float = 0.0, generator: Optional[torch.Generator] = None
                              ) -> tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor]:
        """`draft`'s (drafts, q) and each draft's predicted acceptance probability `[n, num_drafts]` (given the
        drafts before it were accepted), computed from the drafter's own states and drafts only (never from the
        target), so that truncating on it keeps decoding lossless. Only where `has_confidence`."""
        raise ValueError(f"--confidence-threshold: the {self.architecture} drafter has no confidence head; "
                         "evaluate it without the option")

    def draft(self, hidden: torch.Tensor, lm_head: nn.Module, anchor_ids: torch.Tensor, temperature: float = 0.0,
              generator: Optional[torch.Generator] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The drafts `[n, num_drafts]` (target ids; here slots 1..) of `n` blocks, from their final hidden states
        `[n, bs, H]` (slot 0 is the anchor, `anchor_ids [n]`): the argmax of each slot, or with `temperature > 0` a
        sample from `q = softmax(logits / temperature)`, returned too over the target's vocabulary (`[n, bs-1, V]`,
        0 outside a reduced draft vocabulary) for speculative sampling. Every row goes through the head and the
        anchor's is dropped (on CPU a 15-row product with a large lm_head costs twice a 16-row one)."""
        logits = self.logits(hidden, lm_head)[:, 1:].float()
        if temperature <= 0:
            return self.target_ids(logits.argmax(-1)), None
        q = torch.softmax(logits / temperature, -1)
        drafts = torch.multinomial(q.reshape(-1, q.shape[-1]), 1, generator=generator).view(q.shape[:-1])
        if self.draft_vocab_size:
            full = q.new_zeros(*q.shape[:-1], lm_head.weight.shape[0])
            q = full.index_copy_(-1, self.vocabulary_ids(), q)
        return self.target_ids(drafts), q

    @property
    def export_needs_target_head(self) -> bool:
        """Whether `materialized` needs the target's lm_head weight (else it returns the drafter itself)."""
        return False

    def materialized(self, head_weight: torch.Tensor) -> "Drafter":
        """This drafter in its reference layout, for an export: itself, unless some of its trained weights are a
        training-time parametrisation that needs the target's lm_head weight `[V, H]` to become reference tensors
        (e.g. factored codebooks computed through the target's head)."""
        return self

    def check_tree_decoding(self) -> None:
        """Raise a user error (ValueError naming --tree-budget) where this drafter cannot give DDTree candidates
        (`tree_candidates`); decoding calls it before the first prompt. Every drafter can here."""

    def tree_candidates(self, hidden: torch.Tensor, lm_head: nn.Module, anchor_ids: torch.Tensor,
                        k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Each drafted slot's candidate next tokens (target ids, `[n, D, k]`, D = `num_drafts()`: the tree's
        depth) and their log-probabilities for a DDTree over the block (`SpeculativeDecoder.build_tree_from_top`):
        `[n, D, k]` when each slot's distribution is its own (here, slots 1..: its `k` best, best first), or
        `[n, D, k, k]` when it depends on the token before (row p: given candidate p of the depth before; depth
        0's rows given the anchor; an architecture with a pairwise model overrides this)."""
        return self._top_candidates(self.logits(hidden, lm_head)[:, 1:].float(), k)

    def _top_candidates(self, logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Each slot's `k` best tokens (target ids) and their log-probabilities, from its own scores `[n, D, V]`."""
        top_lp, top = torch.log_softmax(logits, -1).topk(min(k, logits.shape[-1]), dim=-1)
        return top_lp, self.target_ids(top)

    def greedy_proposals(self, hidden: torch.Tensor, lm_head: nn.Module, anchor_ids: torch.Tensor,
                         k: int = 0) -> BlockProposals:
        """What replay needs of a chunk of blocks: `draft`'s greedy drafts, with `k > 0` `tree_candidates(k)`, and
        where `has_confidence` `draft_with_confidence`'s predictions. Where `draft` and `tree_candidates` are this
        class's own (every slot's distribution its own), from one product with the head, not two: on a small
        target's large vocabulary that product is most of the drafter's work. An architecture that overrides
        either gets the separate calls unless it overrides this too."""
        if (type(self).draft is not Drafter.draft or type(self).tree_candidates is not Drafter.tree_candidates
                or self.has_confidence):
            if self.has_confidence:
                drafts, _, confidence = self.draft_with_confidence(hidden, lm_head, anchor_ids)
            else:
                drafts, confidence = self.draft(hidden, lm_head, anchor_ids)[0], None
            top_lp, top_ids = self.tree_candidates(hidden, lm_head, anchor_ids, k) if k else (None, None)
            return BlockProposals(drafts, top_lp, top_ids, confidence)
        logits = self.logits(hidden, lm_head)[:, 1:].float()
        top_lp, top_ids = self._top_candidates(logits, k) if k else (None, None)
        return BlockProposals(self.target_ids(logits.argmax(-1)), top_lp, top_ids)


class Objective(Protocol):
    """An architecture's training objective on one micro-batch, graph kept for backward. `generator` draws
    the anchors; `call` runs the drafter's forward (its DDP wrapper on several ranks); `hidden` is the
    target's capture when another rank computed it."""

    def __call__(self, batch: "Batch", generator: torch.Generator, call: Optional[Callable] = None,
                 hidden: Optional[torch.Tensor] = None) -> StepStats: ...

    def describe(self) -> str:
        """What it optimises, in words, for the run's log."""
        ...


@dataclass(frozen=True)
class StepMemory:
    """An architecture's own terms in the drafter step's activation estimate (train/activation_memory.py
    `drafter_step_parts`), beside the generic ones every block drafter's step has (its layers, the lm_head + CE
    chunk); all zero here. `e` is the compute dtype's bytes. An architecture with more overrides these from its drafter config
    (`Architecture.step_memory`)."""

    def ce_chunk_per_class(self, e: int, compiled: bool) -> int:
        """Bytes more per [row, class] of one lm_head + CE chunk (`compiled`: its math fused, on a GPU)."""
        return 0

    def head_columns(self) -> int:
        """Columns the loss appends to its compute-dtype copy of the head `[classes, H]` for its product (a table
        of its own scored beside the head), 0 where it uses the head as it is."""
        return 0

    def layer_per_query(self, hidden: int) -> int:
        """Values (compute dtype) more that one drafter layer saves for its backward, per query token."""
        return 0

    def on_top(self, counted: int, head_classes: int, e: int) -> dict[str, int]:
        """Named parts that run on top of every layer's saved activations (the estimate counts the largest of
        these and the generic ones: the lm_head + CE chunk, one layer's backward), over `counted` rows."""
        return {}

    def loss_rows(self, counted: int) -> int:
        """Bytes more the loss keeps for its `counted` rows until the backward."""
        return 0


def one_parameter_group(drafter: Drafter, cfg: "Config") -> list[dict]:
    """Every trained parameter at `optim.lr` (the default `Architecture.parameter_groups`)."""
    return [{"params": [p for p in drafter.parameters() if p.requires_grad]}]


def no_step_memory(drafter_config: "PretrainedConfig") -> StepMemory:
    return StepMemory()


@dataclass(frozen=True)
class StepFlops:
    """An architecture's own modules in the model FLOPs of a training step (train/flops.py `drafter_flop_parts`),
    beside the generic ones every block drafter's step has (fc, layers, attention, the vocabulary head); none here.
    An architecture with more overrides `parts` from its drafter config (`Architecture.step_flops`)."""

    def parts(self, work: DraftWork) -> dict[str, float]:
        """Named useful FLOPs, forward + backward, of the modules of its own over a step's (or a micro-batch's)
        drafter work (`DraftWork`: blocks, block tokens, counted rows, target positions)."""
        return {}


def no_step_flops(drafter_config: "PretrainedConfig") -> StepFlops:
    return StepFlops()


@dataclass(frozen=True)
class Architecture:
    """What the registry resolves a `drafter.architecture` to. The run's config reaches an architecture whole
    (`Config`): its own section, when it declares one (`architectures.Options`), is `cfg.options`."""

    name: str  # the `drafter.architecture` value
    hf_architecture: str  # `architectures[0]` of its exported config.json
    drafter_class: Callable[["PretrainedConfig"], Drafter]
    # (target config, the run's config, target layer ids, mask token id) -> drafter config
    config_for_run: Callable[..., "PretrainedConfig"]
    config_from_dict: Callable[[dict], "PretrainedConfig"]  # an exported config.json -> drafter config
    config_json: Callable[[Drafter, str], dict]  # (drafter, dtype name) -> the config.json it exports
    resolve_backend: Callable[..., Any]  # (requested, device, block_size, training) -> attention backend
    objective: Callable[[Drafter, Any, Any, "Config", torch.dtype], Objective]  # (drafter, target, backend, cfg, dtype)
    # (drafter, cfg) -> AdamW's parameter groups (a group may set its own "lr"; the schedule scales every group's)
    parameter_groups: Callable[[Drafter, "Config"], list[dict]] = one_parameter_group
    # the drafter config -> its terms in the step's activation estimate (train/activation_memory.py)
    step_memory: Callable[["PretrainedConfig"], StepMemory] = no_step_memory
    # the drafter config -> its own modules' FLOPs in the step's model FLOPs and MFU (train/flops.py)
    step_flops: Callable[["PretrainedConfig"], StepFlops] = no_step_flops
    # Whether its objective reads the target's final normed hidden states (target.capture(..., with_final=True)):
    # the step's memory estimate then counts them and their counted rows, as it does for distillation.
    needs_target_final: bool = False
