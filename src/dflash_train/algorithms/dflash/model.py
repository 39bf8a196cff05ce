"""The DFlash drafter: Qwen3-style layers with the target's context injected as keys/values.

Semantics follow the reference implementation (z-lab/dflash): the K captured target layers are
fused by `fc` + `hidden_norm` once per forward; every layer's queries come from the block tokens
only, its keys/values are `cat[proj(context), proj(block)]` with shared projections (k gets its
norm), RoPE runs over all keys and queries take the block part. The drafter owns its final
`norm` but no embedding and no lm_head: those are the target's, frozen.

Parameter names equal the export tensor names (`layers.{i}.self_attn.q_proj.weight`, `fc.weight`, ...).
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import torch
from torch import nn
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RotaryEmbedding

from ..base import (FULL_ATTENTION, AttentionFn, AttentionKind, Drafter, DrafterKVCache,  # noqa: F401
                    draft_vocab_size_of, sdpa_attention)
from .mask import dense_mask


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x `[b, heads, n, d]`, cos/sin `[b, n, d]`."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + _rotate_half(x) * sin


class RopeTables(NamedTuple):
    """cos/sin `[b, n, d]` of the context's positions and of the block's."""

    cos_context: torch.Tensor
    sin_context: torch.Tensor
    cos_block: torch.Tensor
    sin_block: torch.Tensor


# `drafter.compile`'s torch.compile backend; CPU tests swap in Dynamo's "eager" (tracing, guards and
# recompiles without inductor).
COMPILE_BACKEND = "inductor"

try:
    _FUSED_RMS_NORM = torch.ops.aten._fused_rms_norm
except (AttributeError, RuntimeError) as missing:  # torch's fused RMSNorm op arrived in 2.8, our lowest pin
    raise ImportError(f"torch {torch.__version__} has no aten._fused_rms_norm; dflash-train needs torch >= 2.8 "
                      "(pip install -U torch)") from missing


class RMSNorm(nn.Module):
    """Qwen3's RMSNorm through torch's fused kernel, in the activations' dtype (statistics in float32
    inside the kernel). `aten._fused_rms_norm` (what `F.rms_norm` runs) is called directly: CUDA's autocast
    lists `rms_norm` among its float32 ops and would return float32, while the fused op is on no autocast
    list, so bf16 activations stay bf16 without an autocast context inside the compiled layers (a context there
    makes AOTAutograd's cache refuse the whole graph, so every start traced its joint graph again)."""

    def __init__(self, size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _FUSED_RMS_NORM(x, [x.shape[-1]], self.weight.to(x.dtype), self.eps)[0]


class Rotary:
    """RoPE tables for the drafter. Not an nn.Module on purpose: `drafter.to(bfloat16)` must not
    round the float32 inverse frequencies (that would shift every position's angle)."""

    def __init__(self, config: Qwen3Config):
        reference = Qwen3RotaryEmbedding(config)  # the library computes every rope_type
        self.inv_freq = reference.inv_freq.detach().float().clone()
        self.attention_scaling = float(reference.attention_scaling)
        self._per_device: dict[torch.device, torch.Tensor] = {}

    def __call__(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        device = position_ids.device
        inv_freq = self._per_device.get(device)
        if inv_freq is None:
            inv_freq = self._per_device.setdefault(device, self.inv_freq.to(device))
        freqs = position_ids[..., None].float() * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.attention_scaling).to(dtype), (emb.sin() * self.attention_scaling).to(dtype)


class DFlashAttention(nn.Module):
    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.head_dim = config.head_dim
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        bias = config.attention_bias
        h = config.hidden_size
        self.q_proj = nn.Linear(h, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, h, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def project(self, x: torch.Tensor, context: torch.Tensor, rope: RopeTables) -> tuple[torch.Tensor, ...]:
        """Queries from the (normed) block `x`; keys/values of the context and of the block, projected
        by the same weights, k normed, RoPE on q and k: q `[b, nh, Q, d]`, then k and v of the context
        `[b, nkv, S, d]` and of the block `[b, nkv, Q, d]`. The caller concatenates them: no tensor here
        is S + Q long, so compiled graphs see only the two lengths themselves."""
        b, q_len, _ = x.shape
        ctx_len = context.shape[1]
        q = self.q_norm(self.q_proj(x).view(b, q_len, self.num_heads, self.head_dim)).transpose(1, 2)

        def keys_values(h: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
            k = self.k_norm(self.k_proj(h).view(b, n, self.num_kv_heads, self.head_dim)).transpose(1, 2)
            return k, self.v_proj(h).view(b, n, self.num_kv_heads, self.head_dim).transpose(1, 2)

        k_ctx, v_ctx = keys_values(context, ctx_len)
        k_blk, v_blk = keys_values(x, q_len)
        q, k_blk = _apply_rope(q, rope.cos_block, rope.sin_block), _apply_rope(k_blk, rope.cos_block, rope.sin_block)
        return q, _apply_rope(k_ctx, rope.cos_context, rope.sin_context), v_ctx, k_blk, v_blk

    def output(self, attn: torch.Tensor) -> torch.Tensor:
        """`[b, nh, Q, d]` attention output -> `[b, Q, H]`."""
        b, _, q_len, _ = attn.shape
        return self.o_proj(attn.transpose(1, 2).reshape(b, q_len, self.num_heads * self.head_dim))


class DFlashDecoderLayer(nn.Module):
    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.self_attn = DFlashAttention(config)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def attention_inputs(self, x: torch.Tensor, context: torch.Tensor, rope: RopeTables):
        # Pre-norm on the block only: the context enters already normalised by hidden_norm.
        return self.self_attn.project(self.input_layernorm(x), context, rope)

    def attention_output_and_mlp(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn.output(attn)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward(self, x, context, rope, attention, mask, cache=None, layer_idx=0, parts=None) -> torch.Tensor:
        """`parts`: compiled versions of (attention_inputs, attention_output_and_mlp), called with the layer
        first (see `DFlashDrafter.compile_layers`); the attention runs between them as its backend's own call."""
        inputs, output = parts or (type(self).attention_inputs, type(self).attention_output_and_mlp)
        q, k_ctx, v_ctx, k_blk, v_blk = inputs(self, x, context, rope)
        k, v = torch.cat([k_ctx, k_blk], dim=2), torch.cat([v_ctx, v_blk], dim=2)  # keys: [context | block]
        if cache is not None:
            k, v = cache.append(layer_idx, k, v)
        return output(self, x, attention(q, k, v, mask))


class DFlashDrafter(Drafter):
    architecture = "dflash"
    layer_class: type = DFlashDecoderLayer

    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.config = config
        dflash = config.dflash_config
        self.block_size: int = config.block_size
        self.mask_token_id: int = dflash["mask_token_id"]
        self.target_layer_ids: list[int] = list(dflash["target_layer_ids"])
        self.read_reference_fields(config)  # output multiplier, softcap, input scale; each layer's attention kind
        h = config.hidden_size
        self.layers = nn.ModuleList([self.layer_class(config) for _ in range(config.num_hidden_layers)])
        self.fc = nn.Linear(len(self.target_layer_ids) * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, eps=config.rms_norm_eps)
        self.norm = RMSNorm(h, eps=config.rms_norm_eps)
        draft_vocab = draft_vocab_size_of(config)
        if draft_vocab:  # a reduced draft vocabulary: its own head and the offsets to target ids (vLLM's names)
            if self.architecture != "dflash":
                raise ValueError(f"a reduced draft vocabulary (draft_vocab_size {draft_vocab}) is implemented for the "
                                 f"dflash architecture only, not {self.architecture}")
            self.lm_head = nn.Linear(h, draft_vocab, bias=False)
            self.register_buffer("d2t", torch.zeros(draft_vocab, dtype=torch.long))
        self.rotary = Rotary(config)
        self._compiled_parts: Optional[tuple[Callable, Callable]] = None
        self.reset_parameters()

    def compile_layers(self, backend: Optional[str] = None) -> None:
        """`drafter.compile`: the memory-bound work around each layer's matmuls (RMSNorms, RoPE, SiLU x mul,
        residual adds, casts) fused by torch.compile, in two graphs shared by every layer (before and after
        the attention, which its backend compiles on its own). Dynamic batch and lengths, through the compile
        layer (one process lock, fullgraph). Used by `forward(..., compiled_layers=True)` only: the training
        step; evaluation and decoding keep the eager layers, whose shapes the warm-up does not cover."""
        from ...accel.compile import compiled

        backend = backend or COMPILE_BACKEND
        layer = self.layer_class
        prefix = "drafter" if self.architecture == "dflash" else f"{self.architecture}_drafter"  # one per layer class
        self._compiled_parts = (
            compiled(f"{prefix}_attention_inputs[{backend}]", layer.attention_inputs, dynamic=True, backend=backend),
            compiled(f"{prefix}_output_and_mlp[{backend}]", layer.attention_output_and_mlp, dynamic=True,
                     backend=backend),
        )

    @property
    def layers_compiled(self) -> bool:
        return self._compiled_parts is not None

    def dense_mask(self, anchors: torch.Tensor, keep: torch.Tensor, context_len: int,
                   kind: AttentionKind = FULL_ATTENTION) -> torch.Tensor:
        """The training layout's boolean mask `[b, 1, N*bs, S + N*bs]` for blocks at `anchors`, for layers
        of `kind`."""
        return dense_mask(anchors, keep, context_len, self.block_size, kind.sliding_window, kind.causal)

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
