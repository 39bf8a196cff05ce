"""LiLiCorr's head and loss written out from the specification, in float64, over plain tensors by their export names
(no package code): what the loss test and the export's independent reader compare the package against."""

from __future__ import annotations

import math

import torch


def rms(x, w, eps):
    return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps) * w


def linear(t, name, x):
    return x @ t[name + ".weight"].T + t[name + ".bias"]


def unit(x, eps):
    return x / torch.clamp(x.norm(dim=-1, keepdim=True), min=eps)


def head_scores(t: dict, f: dict, hidden: int, rms_eps: float, embeds, pass_hidden, lp, anchor, valid: bool):
    """One block: `t` the head's tensors by name (no `lilicorr.` prefix), `f` the `lilicorr_*` fields, `embeds
    [S, k, H]`, `pass_hidden [S, H]`, `lp [S, k]`, `anchor [H]`. Returns (log_start [k], log_pair [S-1, k, k])."""
    slots, k = lp.shape
    heads = f["lilicorr_num_heads"]
    width = f["lilicorr_hidden_size"] or hidden
    rank = torch.arange(k, dtype=lp.dtype)
    feats = torch.stack([lp, lp.exp(), lp - lp.max(-1, keepdim=True).values,
                         (rank / (k - 1) if k > 1 else 0 * rank).expand(slots, k), (rank == 0).to(lp.dtype).expand(slots, k)], -1)
    mu = feats.mean(-1, keepdim=True)
    var = ((feats - mu) ** 2).mean(-1, keepdim=True)
    feats = (feats - mu) / torch.sqrt(var + 1e-5) * t["feature_mlp.0.weight"] + t["feature_mlp.0.bias"]
    feats = linear(t, "feature_mlp.3", torch.nn.functional.silu(linear(t, "feature_mlp.1", feats)))
    token = linear(t, "token_proj", embeds) if width != hidden else embeds
    x = token + linear(t, "pass_hidden_proj", pass_hidden)[:, None] + feats
    x = x + t["slot_embedding"].reshape(-1, width)[:slots, None] + t["rank_embedding"].reshape(k, width)[None]
    x = x.reshape(slots * k, width)
    slot = [i // k for i in range(slots * k)]
    size = t["relative_slot_bias"].shape[1]
    block = (size + 1) // 2
    bias = torch.stack([torch.stack([torch.stack([
        t["relative_slot_bias"][h, slot[i] - slot[j] + block - 1] + (t["same_slot_bias"][h] if slot[i] == slot[j] else 0)
        for j in range(slots * k)]) for i in range(slots * k)]) for h in range(heads)])
    for layer in range(f["lilicorr_num_layers"]):
        p = f"layers.{layer}."
        y = rms(x, t[p + "attn_norm.weight"], rms_eps)
        qkv = y @ t[p + "attn.in_proj_weight"].T + t[p + "attn.in_proj_bias"]
        q, kk, v = qkv.split(width, -1)
        d = width // heads
        outs = []
        for h in range(heads):
            s = q[:, h * d:(h + 1) * d] @ kk[:, h * d:(h + 1) * d].T / math.sqrt(d) + bias[h]
            outs.append(torch.softmax(s, -1) @ v[:, h * d:(h + 1) * d])
        x = x + linear(t, p + "attn.out_proj", torch.cat(outs, -1))
        y = rms(x, t[p + "mlp_norm.weight"], rms_eps)
        x = x + linear(t, p + "mlp.2", torch.nn.functional.silu(linear(t, p + "mlp.0", y)))
    x = rms(x, t["output_norm.weight"], rms_eps)
    u = linear(t, "context_proj", anchor * valid) * valid
    u = rms(u, t["anchor_norm.weight"], rms_eps)
    uu = u.expand_as(x)
    g = torch.nn.functional.silu(linear(t, "factor_input_proj", torch.cat([x, uu, x * uu], -1)))
    eps, scale = f["lilicorr_vector_eps"], f["lilicorr_logit_scale"]
    out = unit(linear(t, "out_head", g), eps).view(slots, k, -1)
    inn = unit(linear(t, "in_head", g), eps).view(slots, k, -1)
    anchor_out = unit(linear(t, "anchor_out_head", u), eps)
    log_start = scale * (inn[0] @ anchor_out)
    log_pair = scale * torch.stack([out[s] @ inn[s + 1].T for s in range(slots - 1)])
    return log_start, log_pair


def walk(log_start, log_pair) -> list[int]:
    """The greedy walk, one slot at a time in plain Python (first maximum on ties)."""
    def first_max(row):
        values = row.tolist()
        return values.index(max(values))

    ranks = [first_max(log_start)]
    for s in range(log_pair.shape[0]):
        ranks.append(first_max(log_pair[s][ranks[-1]]))
    return ranks
