"""The `lilicorr` head: scores transitions between adjacent slots' candidates (the lattice). Per block of B slots,
the S = B - 1 drafted slots each hold their k candidates (the backbone's k best tokens, rank 0 its argmax):

  x[s, r] = token_proj(E[c]) + pass_hidden_proj(h_s) + feature_mlp(features) + slot_embedding[s] + rank_embedding[r]
  features = [lp, exp(lp), lp - max_r lp, r / (k - 1), 1[r = 0]]     (lp: the candidate's log-probability)

then `num_layers` pre-norm layers over the S*k nodes (attention unmasked, with a per-head bias by signed slot distance
and for same-slot pairs; a plain Linear-SiLU-Linear MLP), `output_norm`; the anchor state
`u = anchor_norm(context_proj(anchor row))` (0 without one), `g = SiLU(factor_input_proj([x, u, x * u]))`, unit
vectors `out = n(out_head(g))`, `in = n(in_head(g))`, `anchor_out = n(anchor_out_head(u))`, and the log-potentials
  log_start[j] = scale * <anchor_out, in[0, j]>,   log_pair[s, i, j] = scale * <out[s, i], in[s + 1, j]>
in float32. Parameter names and shapes are those the engines load (`lilicorr.` prefixed in the export).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from ..family.layers import RMSNorm

FEATURES = 5
# Lattice nodes the head trains on at once, at the least: with gradients it runs over chunks of whole blocks, each
# recomputed in the backward (activation checkpointing), so what it keeps to the backward is one chunk's activations
# and not every block's (hundreds of GB at the bench's micro-batch of 16 rows x 512 blocks x 120 nodes).
CHUNK_NODES = 16384
# The most chunks a step's lattice is split into. Each chunk costs the host a few milliseconds whatever its size (the
# checkpoint's hooks, the compiled graph's calls, some 300 kernel launches): at the SmolLM2 bench's shape, 61 chunks
# of CHUNK_NODES made a ~1.2 s step of 0.68 s of kernels (docs/results/performance.md).
MAX_CHUNKS = 16


def chunk_blocks(max_blocks: int, slots: int, topk: int) -> int:
    """Blocks one training chunk holds where a step's lattice has at most `max_blocks` blocks of `slots` x `topk`
    nodes: at least `CHUNK_NODES` nodes' worth, and enough that the lattice takes at most `MAX_CHUNKS` chunks."""
    return max(1, CHUNK_NODES // (slots * topk), -(-max_blocks // MAX_CHUNKS))


def wide(x: torch.Tensor) -> torch.Tensor:
    """`x` in float32, or wider (float64 in tests)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


class LatticeLayer(nn.Module):
    def __init__(self, width: int, heads: int, mlp_ratio: float, eps: float):
        super().__init__()
        self.attn_norm = RMSNorm(width, eps)
        self.attn = nn.MultiheadAttention(width, heads, batch_first=True)  # the packed q, k, v layout
        self.mlp_norm = RMSNorm(width, eps)
        inner = int(width * mlp_ratio)
        self.mlp = nn.Sequential(nn.Linear(width, inner), nn.SiLU(), nn.Linear(inner, width))

    def attention(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """`nn.MultiheadAttention`'s math, `bias [heads, L, L]` added to the scores."""
        n, length, width = x.shape
        heads = self.attn.num_heads
        q, k, v = F.linear(x, self.attn.in_proj_weight, self.attn.in_proj_bias).chunk(3, -1)
        q, k, v = (t.view(n, length, heads, width // heads).transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias.to(q.dtype).unsqueeze(0))
        return self.attn.out_proj(out.transpose(1, 2).reshape(n, length, width))

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attn_norm(x), bias)
        return x + self.mlp(self.mlp_norm(x))


class LiLiCorrHead(nn.Module):
    def __init__(self, hidden: int, block_size: int, topk: int, width: int, num_layers: int, heads: int,
                 mlp_ratio: float, factor_dim: int, vector_eps: float, logit_scale: float, rms_eps: float):
        """`width` 0: as wide as the drafter (`hidden`), with no token projection."""
        super().__init__()
        self.configured_width = width
        h = width or hidden
        self.topk, self.heads, self.block_size = topk, heads, block_size
        self.mlp_ratio, self.vector_eps, self.logit_scale = mlp_ratio, vector_eps, logit_scale
        self.token_proj = nn.Linear(hidden, h) if h != hidden else nn.Identity()
        self.pass_hidden_proj = nn.Linear(hidden, h)
        self.feature_mlp = nn.Sequential(nn.LayerNorm(FEATURES), nn.Linear(FEATURES, h), nn.SiLU(), nn.Linear(h, h))
        self.slot_embedding = nn.Parameter(torch.zeros(1, 1, block_size - 1, 1, h))
        self.rank_embedding = nn.Parameter(torch.zeros(1, 1, 1, topk, h))
        self.relative_slot_bias = nn.Parameter(torch.zeros(heads, 2 * block_size - 1))
        self.same_slot_bias = nn.Parameter(torch.zeros(heads))
        self.context_proj = nn.Linear(hidden, h)
        self.layers = nn.ModuleList([LatticeLayer(h, heads, mlp_ratio, rms_eps) for _ in range(num_layers)])
        self.output_norm = RMSNorm(h, rms_eps)
        self.anchor_norm = RMSNorm(h, rms_eps)
        self.factor_input_proj = nn.Linear(3 * h, h)
        self.out_head = nn.Linear(h, factor_dim)
        self.in_head = nn.Linear(h, factor_dim)
        self.anchor_out_head = nn.Linear(h, factor_dim)

    def exported_fields(self) -> dict[str, Any]:
        """The `lilicorr_*` fields of the export's dflash_config, read off this head."""
        return {"lilicorr_candidate_topk": self.topk, "lilicorr_hidden_size": self.configured_width,
                "lilicorr_num_layers": len(self.layers), "lilicorr_num_heads": self.heads,
                "lilicorr_mlp_ratio": float(self.mlp_ratio), "lilicorr_factor_dim": self.out_head.out_features,
                "lilicorr_vector_eps": float(self.vector_eps), "lilicorr_logit_scale": float(self.logit_scale)}

    @torch.no_grad()
    def reset_parameters(self, std: float) -> None:
        """Every Linear (the attention's output projection too) N(0, std), bias 0; the attention's packed input
        projection xavier-uniform, bias 0 (not a Linear); the embeddings and biases by slot 0; norms 1. The factor
        heads are drawn again after the rest: zero on both sides of a bilinear score would be a dead saddle."""
        for m in self.modules():
            if isinstance(m, nn.Linear):
                m.weight.normal_(0.0, std)
                m.bias.zero_()
            elif isinstance(m, (RMSNorm, nn.LayerNorm)):
                m.weight.fill_(1.0)
                if getattr(m, "bias", None) is not None:
                    m.bias.zero_()
            elif isinstance(m, nn.MultiheadAttention):
                nn.init.xavier_uniform_(m.in_proj_weight)
                m.in_proj_bias.zero_()
        for p in (self.slot_embedding, self.rank_embedding, self.relative_slot_bias, self.same_slot_bias):
            p.zero_()
        for m in (self.out_head, self.in_head, self.anchor_out_head):
            m.weight.normal_(0.0, std)
            m.bias.zero_()

    def slot_bias(self, slots: int) -> torch.Tensor:
        """The attention bias `[heads, S*k, S*k]` over the lattice's nodes (node i in slot i // k)."""
        slot = torch.arange(slots, device=self.same_slot_bias.device).repeat_interleave(self.topk)
        distance = slot.view(-1, 1) - slot.view(1, -1)
        bias = self.relative_slot_bias[:, distance + self.block_size - 1]
        return bias + self.same_slot_bias.view(-1, 1, 1) * (distance == 0)

    def forward(self, cand_embeds: torch.Tensor, pass_hidden: torch.Tensor, lp: torch.Tensor,
                anchor_hidden: torch.Tensor, anchor_valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`cand_embeds [n, S, k, H]` the candidates' target embeddings, `pass_hidden [n, S, H]` the slots' final
        hidden states, `lp [n, S, k]` the candidates' log-probabilities (best first), `anchor_hidden [n, H]` the
        anchor row and `anchor_valid [n]` where there is one. Returns (log_start `[n, k]`, log_pair
        `[n, S-1, k, k]`), float32."""
        return self.scores(*self.vectors(cand_embeds, pass_hidden, lp, anchor_hidden, anchor_valid))

    def vectors(self, cand_embeds: torch.Tensor, pass_hidden: torch.Tensor, lp: torch.Tensor,
                anchor_hidden: torch.Tensor, anchor_valid: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`forward`'s unit factor vectors (out `[n, S, k, f]`, in `[n, S, k, f]`, anchor_out `[n, f]`, float32):
        all of the head but the cosines. The part a compiled training step fuses (`LiLiCorrDrafter.compile_layers`);
        it enters no autocast context of its own, which a cached compiled graph may not hold."""
        n, slots, k = lp.shape
        lp = wide(lp)
        rank = torch.arange(k, device=lp.device, dtype=lp.dtype)
        features = torch.stack([lp, lp.exp(), lp - lp.amax(-1, keepdim=True),
                                (rank / (k - 1) if k > 1 else rank * 0).expand_as(lp), (rank == 0).to(lp.dtype)
                                .expand_as(lp)], -1)
        features = features.to(self.feature_mlp[1].weight.dtype)  # autocast, where on, casts it again
        x = (self.token_proj(cand_embeds) + self.pass_hidden_proj(pass_hidden).unsqueeze(2)
             + self.feature_mlp(features) + self.slot_embedding[0, 0, :slots] + self.rank_embedding[0, 0, 0])
        x = x.reshape(n, slots * k, x.shape[-1])  # n may be 0 (no block whose every slot counts)
        bias = self.slot_bias(slots)
        for layer in self.layers:
            x = layer(x, bias)
        x = self.output_norm(x)
        valid = anchor_valid.to(x.dtype).view(n, 1)
        u = self.anchor_norm(self.context_proj(anchor_hidden.to(x.dtype) * valid) * valid)
        uu = u.unsqueeze(1).expand_as(x)
        g = F.silu(self.factor_input_proj(torch.cat([x, uu, x * uu], -1)))
        f = self.out_head.out_features
        out = F.normalize(wide(self.out_head(g)), dim=-1, eps=self.vector_eps).view(n, slots, k, f)
        inn = F.normalize(wide(self.in_head(g)), dim=-1, eps=self.vector_eps).view(n, slots, k, f)
        anchor_out = F.normalize(wide(self.anchor_out_head(u)), dim=-1, eps=self.vector_eps)
        return out, inn, anchor_out

    def scores(self, out: torch.Tensor, inn: torch.Tensor, anchor_out: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """(log_start `[n, k]`, log_pair `[n, S-1, k, k]`): the scaled cosines of `vectors`' output, in float32
        (not the compute dtype)."""
        with torch.autocast(out.device.type, enabled=False):
            log_start = self.logit_scale * torch.einsum("nf,nkf->nk", anchor_out, inn[:, 0])
            log_pair = self.logit_scale * torch.einsum("nsif,nsjf->nsij", out[:, :-1], inn[:, 1:])
        return log_start, log_pair


def greedy_walk(log_start: torch.Tensor, log_pair: torch.Tensor) -> torch.Tensor:
    """The lattice walk decoding drafts by: `c_0 = argmax log_start`, `c_s = argmax log_pair[s-1][c_{s-1}, :]`
    (ties to the lowest rank). Returns the chosen ranks `[n, S]`."""
    choice = [log_start.argmax(-1)]
    for s in range(log_pair.shape[1]):
        row = log_pair[:, s].gather(1, choice[-1].view(-1, 1, 1).expand(-1, 1, log_pair.shape[-1])).squeeze(1)
        choice.append(row.argmax(-1))
    return torch.stack(choice, 1)
