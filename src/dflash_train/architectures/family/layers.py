"""The block drafters' layers: Qwen3-style decoder layers whose queries come from the block's tokens only and whose
keys/values are `cat[proj(context), proj(block)]` with shared projections (k gets its norm), RoPE over all keys, the
queries taking the block part (the reference's semantics, z-lab/dflash). Parameter names equal the export tensor
names (`self_attn.q_proj.weight`, `mlp.gate_proj.weight`, ...).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RotaryEmbedding


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


class BlockAttention(nn.Module):
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


class BlockDecoderLayer(nn.Module):
    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.self_attn = BlockAttention(config)
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
        first (see `BlockDrafter.compile_layers`); the attention runs between them as its backend's own call."""
        inputs, output = parts or (type(self).attention_inputs, type(self).attention_output_and_mlp)
        q, k_ctx, v_ctx, k_blk, v_blk = inputs(self, x, context, rope)
        k, v = torch.cat([k_ctx, k_blk], dim=2), torch.cat([v_ctx, v_blk], dim=2)  # keys: [context | block]
        if cache is not None:
            k, v = cache.append(layer_idx, k, v)
        return output(self, x, attention(q, k, v, mask))
