"""The DFlash drafter: Qwen3-style layers with the target's context injected as keys/values.

Semantics follow the reference implementation (z-lab/dflash): the K captured target layers are
fused by `fc` + `hidden_norm` once per forward; every layer's queries come from the block tokens
only, its keys/values are `cat[proj(context), proj(block)]` with shared projections (k gets its
norm), RoPE runs over all keys and queries take the block part. The drafter owns its final
`norm` but no embedding and no lm_head: those are the target's, frozen.

Parameter names equal the export tensor names (`layers.{i}.self_attn.q_proj.weight`, `fc.weight`, ...).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RotaryEmbedding


def default_target_layer_ids(num_target_layers: int, num_ids: int) -> list[int]:
    """The reference rule: one id -> the middle layer; else evenly from layer 1 to L - 3."""
    if num_ids == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    return [int(round(start + i * (end - start) / (num_ids - 1))) for i in range(num_ids)]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


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


class RMSNorm(nn.Module):
    """Qwen3's RMSNorm through torch's fused kernel, in the activations' dtype (statistics in float32
    inside the kernel). Autocast is switched off around it so bf16 activations stay bf16."""

    def __init__(self, size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(x.device.type, enabled=False):
            return F.rms_norm(x, (x.shape[-1],), self.weight.to(x.dtype), self.eps)


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

    def forward(
        self,
        x: torch.Tensor,
        context: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attention: AttentionFn,
        mask: object,
        cache: Optional["DrafterKVCache"] = None,
        layer_idx: int = 0,
    ) -> torch.Tensor:
        b, q_len, _ = x.shape
        ctx_len = context.shape[1]
        q = self.q_norm(self.q_proj(x).view(b, q_len, self.num_heads, self.head_dim)).transpose(1, 2)
        kv_in = torch.cat([context, x], dim=1)
        k = self.k_norm(self.k_proj(kv_in).view(b, ctx_len + q_len, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(kv_in).view(b, ctx_len + q_len, self.num_kv_heads, self.head_dim).transpose(1, 2)
        # cos/sin cover the new keys [context | block]; queries take the block part.
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q = q * cos[:, :, -q_len:] + _rotate_half(q) * sin[:, :, -q_len:]
        k = k * cos + _rotate_half(k) * sin
        if cache is not None:
            k, v = cache.append(layer_idx, k, v)
        out = attention(q, k, v, mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, q_len, self.num_heads * self.head_dim))


class DFlashDecoderLayer(nn.Module):
    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.self_attn = DFlashAttention(config)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, x, context, cos, sin, attention, mask, cache=None, layer_idx=0) -> torch.Tensor:
        # Pre-norm on the block only: the context enters already normalised by hidden_norm.
        x = x + self.self_attn(self.input_layernorm(x), context, cos, sin, attention, mask, cache, layer_idx)
        return x + self.mlp(self.post_attention_layernorm(x))


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


class DFlashDrafter(nn.Module):
    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.config = config
        dflash = config.dflash_config
        self.block_size: int = config.block_size
        self.mask_token_id: int = dflash["mask_token_id"]
        self.target_layer_ids: list[int] = list(dflash["target_layer_ids"])
        h = config.hidden_size
        self.layers = nn.ModuleList([DFlashDecoderLayer(config) for _ in range(config.num_hidden_layers)])
        self.fc = nn.Linear(len(self.target_layer_ids) * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, eps=config.rms_norm_eps)
        self.norm = RMSNorm(h, eps=config.rms_norm_eps)
        self.rotary = Rotary(config)
        self.reset_parameters()

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
    ) -> torch.Tensor:
        """target_hidden `[b, S, K*H]`, block_embeds `[b, Q, H]`, position_ids `[b, S + Q]` (positions of
        the new keys: context then block). Returns the normed hidden states of the block `[b, Q, H]`."""
        context = self.hidden_norm(self.fc(target_hidden))
        x = block_embeds
        cos, sin = self.rotary(position_ids, x.dtype)
        for i, layer in enumerate(self.layers):
            x = layer(x, context, cos, sin, attention, mask, cache, i)
        return self.norm(x)
