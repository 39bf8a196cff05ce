"""The block drafter every architecture of the family builds on: the K captured target layers fused by `fc` +
`hidden_norm` once per forward, then `layers` (`layers.BlockDecoderLayer`, or a subclass's `layer_class`) over the
block tokens with the context injected as keys/values, then its final `norm`. It owns no embedding and, unless it
has a reduced draft vocabulary, no lm_head: those are the target's, frozen. Decoding ranks `logits`, the head's
scores under the reference's output fields; every slot after the anchor drafts from its own scores (`draft`,
`tree_candidates`), which an architecture with a sequential or pairwise model overrides.

Parameter names equal the export tensor names (`layers.{i}.self_attn.q_proj.weight`, `fc.weight`, ...).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable, Optional

import torch
from torch import nn
from transformers import Qwen3Config

from ..attention import AttentionFn, DrafterKVCache
from ..drafter import BlockProposals, Drafter
from .layers import BlockDecoderLayer, RMSNorm, RopeTables, Rotary
from .mask import dense_mask
from .reference_fields import (FULL_ATTENTION, AttentionKind, OutputFields, draft_vocab_size_of, layer_kinds,
                               transform_logits)

# `drafter.compile`'s torch.compile backend; CPU tests swap in Dynamo's "eager" (tracing, guards and
# recompiles without inductor).
COMPILE_BACKEND = "inductor"


class BlockDrafter(Drafter):
    layer_class: type = BlockDecoderLayer
    # Whether a config's `draft_vocab_size` gives it its own head over a reduced vocabulary (its architecture's
    # options declare `draft_vocabulary` then); elsewhere such a config is refused.
    reduced_vocabulary: bool = False
    # The six reference fields (`read_reference_fields` sets them from the config; these are the defaults).
    output_fields: OutputFields = OutputFields()
    layer_attention: list[AttentionKind]  # one per layer

    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.config = config
        own = config.dflash_config
        self.block_size: int = config.block_size
        self.mask_token_id: int = own["mask_token_id"]
        self.target_layer_ids: list[int] = list(own["target_layer_ids"])
        self.read_reference_fields(config)  # output multiplier, softcap, input scale; each layer's attention kind
        h = config.hidden_size
        self.layers = nn.ModuleList([self.layer_class(config) for _ in range(config.num_hidden_layers)])
        self.fc = nn.Linear(len(self.target_layer_ids) * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, eps=config.rms_norm_eps)
        self.norm = RMSNorm(h, eps=config.rms_norm_eps)
        draft_vocab = draft_vocab_size_of(config)
        if draft_vocab:  # a reduced draft vocabulary: its own head and the offsets to target ids (vLLM's names)
            if not self.reduced_vocabulary:
                raise ValueError(f"a reduced draft vocabulary (draft_vocab_size {draft_vocab}) is not implemented "
                                 f"for the {self.architecture} architecture")
            self.lm_head = nn.Linear(h, draft_vocab, bias=False)
            self.register_buffer("d2t", torch.zeros(draft_vocab, dtype=torch.long))
        self.rotary = Rotary(config)
        self._compiled_parts: Optional[tuple[Callable, Callable]] = None
        self.reset_parameters()

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

    @torch.no_grad()
    def reset_parameters(self) -> None:
        std = self.config.initializer_range
        for m in self.modules():
            if isinstance(m, nn.Linear):
                m.weight.normal_(0.0, std)
                if m.bias is not None:
                    m.bias.zero_()
            elif isinstance(m, RMSNorm):
                m.weight.fill_(1.0)

    # ------------------------------------------------------------ compiled layers

    def compiled_name(self) -> str:
        """The name of its compiled layer parts: one pair per architecture, whose layer classes may differ."""
        return f"{self.architecture}_drafter"

    def compile_layers(self, backend: Optional[str] = None) -> None:
        """`drafter.compile`: the memory-bound work around each layer's matmuls (RMSNorms, RoPE, SiLU x mul,
        residual adds, casts) fused by torch.compile, in two graphs shared by every layer (before and after
        the attention, which its backend compiles on its own). Dynamic batch and lengths, through the compile
        layer (one process lock, fullgraph). Used by `forward(..., compiled_layers=True)` only: the training
        step; evaluation and decoding keep the eager layers, whose shapes the warm-up does not cover."""
        from ...accel.compile import compiled

        backend = backend or COMPILE_BACKEND
        layer, prefix = self.layer_class, self.compiled_name()
        self._compiled_parts = (
            compiled(f"{prefix}_attention_inputs[{backend}]", layer.attention_inputs, dynamic=True, backend=backend),
            compiled(f"{prefix}_output_and_mlp[{backend}]", layer.attention_output_and_mlp, dynamic=True,
                     backend=backend),
        )

    @property
    def layers_compiled(self) -> bool:
        return self._compiled_parts is not None

    # ------------------------------------------------------------ masks by layer kind

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

    def dense_mask(self, anchors: torch.Tensor, keep: torch.Tensor, context_len: int,
                   kind: AttentionKind = FULL_ATTENTION) -> torch.Tensor:
        """The training layout's boolean mask `[b, 1, N*bs, S + N*bs]` for blocks at `anchors`, for layers
        of `kind`."""
        return dense_mask(anchors, keep, context_len, self.block_size, kind.sliding_window, kind.causal)

    def dense_masks(self, anchors: torch.Tensor, keep: torch.Tensor,
                    context_len: int) -> dict[AttentionKind, torch.Tensor]:
        """`dense_mask` for every layer kind (what `forward`'s `mask` takes)."""
        return self.layer_masks(lambda kind: self.dense_mask(anchors, keep, context_len, kind))

    def decode_masks(self, context_len: int, block_size: int, device: torch.device) -> Optional[dict]:
        """Masks `[1, 1, bs, S + bs]` per layer kind for decoding with a KV cache (keys: positions 0..S-1 of
        the context, then the block at S): the training layout with one block anchored at S. None when every
        layer is full and non-causal (the layout alone: every key visible)."""
        if not self.needs_masks:
            return None
        anchors = torch.tensor([[context_len]], device=device)
        keep = torch.ones(1, 1, dtype=torch.bool, device=device)
        return self.layer_masks(lambda kind: dense_mask(anchors, keep, context_len, block_size,
                                                        kind.sliding_window, kind.causal))

    # ------------------------------------------------------------ the forward

    def embed_block(self, embed: Callable[[torch.Tensor], torch.Tensor], block_ids: torch.Tensor) -> torch.Tensor:
        """The block's input embeddings (anchor and mask tokens), through the target's embedding `embed`,
        times `input_embedding_scale`. Every path that forms block inputs (training, decoding, replay) calls
        this, so they agree."""
        out = embed(block_ids)
        scale = self.input_embedding_scale
        return out if scale == 1.0 else out * scale

    def forward(
        self,
        target_hidden: torch.Tensor,
        block_embeds: torch.Tensor,
        position_ids: torch.Tensor,
        attention: AttentionFn,
        mask: object,
        cache: Optional[DrafterKVCache] = None,
        compiled_layers: bool = False,
    ) -> torch.Tensor:
        """target_hidden `[b, S, K*H]`, block_embeds `[b, Q, H]` (`embed_block`), position_ids `[b, S + Q]`
        (positions of the new keys: context then block). `mask`: None (every key visible), masks by layer
        kind (`layer_masks`, `dense_masks`, `decode_masks`; built once per forward, each layer takes its
        kind's), or one mask when every layer is of the default kind. Returns the normed hidden states of the
        block `[b, Q, H]`. `compiled_layers`: run the layers' compiled parts (the training step, after
        `compile_layers`)."""
        if compiled_layers and (self._compiled_parts is None or cache is not None):
            raise ValueError("compiled_layers=True needs compile_layers() first and no KV cache (training only)")
        parts = self._compiled_parts if compiled_layers else None
        context = self.hidden_norm(self.fc(target_hidden))
        x = block_embeds
        s = context.shape[1]
        rope = RopeTables(*self.rotary(position_ids[:, :s], x.dtype), *self.rotary(position_ids[:, s:], x.dtype))
        for i, layer in enumerate(self.layers):
            x = layer(x, context, rope, attention, self.mask_of_layer(mask, i), cache, i, parts)
        return self.norm(x)

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

    @torch.no_grad()
    def set_draft_vocabulary(self, target_ids: torch.Tensor, target_lm_head: torch.Tensor) -> None:
        """Make the draft vocabulary the target tokens `target_ids` (`[N]`, ascending): `d2t` their offsets from
        the draft ids, and the drafter's own lm_head their rows of the target's lm_head weight `[V, H]`."""
        n = self.draft_vocab_size
        ids = torch.as_tensor(target_ids, dtype=torch.long).to(self.d2t.device) if n else None
        if ids is None or ids.shape != (n,) or bool((ids[1:] <= ids[:-1]).any()) or int(ids[0]) < 0 \
                or int(ids[-1]) >= target_lm_head.shape[0]:
            raise ValueError(f"a draft vocabulary needs {n or 'draft_vocab_size > 0'} distinct ascending target ids "
                             f"in 0..{target_lm_head.shape[0] - 1}")
        self.d2t.copy_(ids - torch.arange(n, device=ids.device))
        self.lm_head.weight.copy_(target_lm_head.index_select(0, ids.to(target_lm_head.device)))

    def logits(self, hidden: torch.Tensor, lm_head: nn.Module) -> torch.Tensor:
        """Scores (float32) of the block's final hidden states over the drafter's vocabulary: through the
        target's `lm_head` (target ids), or the drafter's own head (draft ids, with a reduced vocabulary):
        `head(h) * output_multiplier`, then the softcap."""
        head = self.vocabulary_head(lm_head)
        out = head(hidden.to(head.weight.dtype)).float()
        return transform_logits(out, self.output_multiplier, self.final_logit_softcapping)

    # ------------------------------------------------------------ proposals

    def num_drafts(self, block_size: Optional[int] = None) -> int:
        """Slot 0 reads the anchor and the other slots are drafts here: bs - 1; an architecture whose anchor slot
        predicts too (the anchor as the first prediction) drafts bs."""
        return (block_size or self.block_size) - 1

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

    def tree_candidates(self, hidden: torch.Tensor, lm_head: nn.Module, anchor_ids: torch.Tensor,
                        k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`Drafter.tree_candidates` where each slot's distribution is its own (slots 1..): its `k` best, best
        first, `[n, D, k]`."""
        return self._top_candidates(self.logits(hidden, lm_head)[:, 1:].float(), k)

    def _top_candidates(self, logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Each slot's `k` best tokens (target ids) and their log-probabilities, from its own scores `[n, D, V]`."""
        top_lp, top = torch.log_softmax(logits, -1).topk(min(k, logits.shape[-1]), dim=-1)
        return top_lp, self.target_ids(top)

    def greedy_proposals(self, hidden: torch.Tensor, lm_head: nn.Module, anchor_ids: torch.Tensor,
                         k: int = 0) -> BlockProposals:
        """`Drafter.greedy_proposals`: where `draft` and `tree_candidates` are this class's own (every slot's
        distribution its own), from one product with the head, not two: on a small target's large vocabulary that
        product is most of the drafter's work. An architecture that overrides either gets the separate calls
        unless it overrides this too."""
        if (type(self).draft is not BlockDrafter.draft or type(self).tree_candidates is not BlockDrafter.tree_candidates
                or self.has_confidence):
            return super().greedy_proposals(hidden, lm_head, anchor_ids, k)
        logits = self.logits(hidden, lm_head)[:, 1:].float()
        top_lp, top_ids = self._top_candidates(logits, k) if k else (None, None)
        return BlockProposals(self.target_ids(logits.argmax(-1)), top_lp, top_ids)
