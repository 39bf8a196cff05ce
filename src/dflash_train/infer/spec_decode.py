"""Speculative decoding with a DFlash drafter: block verification and DDTree tree verification.

Semantics follow the reference implementation (batch size 1):
- prefill the target; its first token is the first anchor; the prompt's captured hidden states
  are the drafter's first context;
- each step the drafter sees `[anchor, MASK x (B-1)]` at positions `start..start+B-1` with all
  context before `start` (its own KV cache holds context keys; block keys are dropped after use);
- the target verifies the block (or the tree) in one forward; the longest agreeing prefix is
  accepted, the target's next token is the bonus and the next anchor; both caches are cut back.
Greedy decoding is lossless: the output equals the target's own greedy output.
"""

from __future__ import annotations

import heapq
import inspect
import time
from dataclasses import dataclass, field
from typing import Optional

import torch
from transformers import DynamicCache

from ..model.drafter import DFlashDrafter, DrafterKVCache, sdpa_attention


@dataclass
class DecodeResult:
    tokens: list[int]  # new tokens, stop token included if one was produced
    accept_lengths: list[int] = field(default_factory=list)  # tokens gained per target forward
    prefill_s: float = 0.0
    decode_s: float = 0.0

    @property
    def tau(self) -> float:
        return sum(self.accept_lengths) / max(len(self.accept_lengths), 1)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _cache_layers(cache: DynamicCache) -> list:
    layers = getattr(cache, "layers", None)
    if layers is None or not all(hasattr(layer, "keys") for layer in layers):
        raise TypeError("speculative decoding needs a key/value cache per layer (full-attention targets only)")
    return layers


def trim_cache(cache: DynamicCache, length: int) -> None:
    for layer in _cache_layers(cache):
        if getattr(layer, "keys", None) is not None and layer.keys.numel():
            layer.keys = layer.keys[..., :length, :]
            layer.values = layer.values[..., :length, :]


def select_cache(cache: DynamicCache, keep: torch.Tensor) -> None:
    """Keep cache positions `keep` (ascending) and drop the rest."""
    for layer in _cache_layers(cache):
        if getattr(layer, "keys", None) is not None and layer.keys.numel():
            layer.keys = layer.keys.index_select(-2, keep)
            layer.values = layer.values.index_select(-2, keep)


def speculative_accept(
    drafts: torch.Tensor,
    draft_logits: torch.Tensor,
    target_logits: torch.Tensor,
    temperature: float,
    generator: torch.Generator,
) -> tuple[int, int]:
    """Speculative sampling over a block: draft i (sampled from q_i) is accepted with probability
    min(1, p_i(d)/q_i(d)); at the first rejection the token comes from max(p_i - q_i, 0) normalised;
    if every draft passes, the bonus comes from p_{n}. Outputs follow the target's distribution.
    `target_logits` has one more row than `drafts`."""
    q = torch.softmax(draft_logits / temperature, -1)
    p = torch.softmax(target_logits / temperature, -1)
    u = torch.rand(len(drafts), generator=generator, device=drafts.device)
    for i, d in enumerate(drafts.tolist()):
        if u[i] > p[i, d] / q[i, d].clamp_min(1e-20):
            residual = (p[i] - q[i]).clamp_min(0)
            residual = residual / residual.sum() if residual.sum() > 0 else p[i]
            return i, int(torch.multinomial(residual, 1, generator=generator))
    return len(drafts), int(torch.multinomial(p[len(drafts)], 1, generator=generator))


class SpeculativeDecoder:
    def __init__(
        self,
        target,
        drafter: DFlashDrafter,
        stop_token_ids: Optional[list[int]] = None,
        temperature: float = 0.0,
        block_size: Optional[int] = None,
        seed: int = 0,
    ):
        self.target, self.drafter = target, drafter
        self.layer_ids = drafter.target_layer_ids
        self.block_size = block_size or drafter.block_size
        self.stop = set(stop_token_ids or [])
        self.temperature = temperature
        self.device = next(target.parameters()).device
        self.embed = target.get_input_embeddings()
        self.lm_head = target.get_output_embeddings()
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        # transformers renamed past_key_values to cache (5.2x); pass whichever this version takes.
        self.cache_kwarg = "cache" if "cache" in inspect.signature(target.forward).parameters else "past_key_values"

    # ---------------------------------------------------------------- target and drafter calls

    def _target(self, ids: torch.Tensor, positions: torch.Tensor, cache: DynamicCache, mask=None):
        out = self.target(
            input_ids=ids.view(1, -1),
            position_ids=positions.view(1, -1),
            use_cache=True,
            output_hidden_states=True,
            **{self.cache_kwarg: cache},
            attention_mask=mask,
        )
        hidden = torch.cat([out.hidden_states[i + 1] for i in self.layer_ids], dim=-1)[0]
        return out.logits[0].float(), hidden

    def _draft_logits(self, context: torch.Tensor, anchor: int, start: int, dcache: DrafterKVCache) -> torch.Tensor:
        """Logits `[B-1, V]` for slots 1..B-1 of the block anchored at `start`."""
        bs = self.block_size
        block = torch.full((1, bs), self.drafter.mask_token_id, dtype=torch.long, device=self.device)
        block[0, 0] = anchor
        positions = torch.arange(dcache.length(), start + bs, device=self.device).view(1, -1)
        dtype = next(self.drafter.parameters()).dtype
        out = self.drafter(context.unsqueeze(0).to(dtype), self.embed(block).to(dtype), positions, sdpa_attention, None, dcache)
        dcache.crop(start)  # keep context keys only
        return self.lm_head(out[0, 1:].to(self.lm_head.weight.dtype)).float()

    def _pick(self, logits: torch.Tensor) -> torch.Tensor:
        if self.temperature <= 0:
            return logits.argmax(-1)
        probs = torch.softmax(logits / self.temperature, -1)
        return torch.multinomial(probs, 1, generator=self.generator).squeeze(-1)

    def _done(self, tokens: list[int], max_new: int) -> bool:
        return len(tokens) >= max_new or any(t in self.stop for t in tokens)

    def _finish(self, tokens: list[int], max_new: int) -> list[int]:
        tokens = tokens[:max_new]
        for i, t in enumerate(tokens):
            if t in self.stop:
                return tokens[: i + 1]
        return tokens

    def _prefill(self, prompt: list[int]):
        cache = DynamicCache()
        ids = torch.tensor(prompt, device=self.device)
        _sync(self.device)
        t0 = time.perf_counter()
        logits, hidden = self._target(ids, torch.arange(len(prompt), device=self.device), cache)
        first = int(self._pick(logits[-1]))
        _sync(self.device)
        return cache, hidden, first, time.perf_counter() - t0

    # ---------------------------------------------------------------- the target alone

    @torch.no_grad()
    def generate_target_only(self, prompt: list[int], max_new_tokens: int) -> DecodeResult:
        cache, _, token, prefill_s = self._prefill(prompt)
        tokens = [token]
        t0 = time.perf_counter()
        while not self._done(tokens, max_new_tokens):
            pos = len(prompt) + len(tokens) - 1
            logits, _ = self._target(torch.tensor([token], device=self.device), torch.tensor([pos], device=self.device), cache)
            token = int(self._pick(logits[-1]))
            tokens.append(token)
        _sync(self.device)
        return DecodeResult(self._finish(tokens, max_new_tokens), [1] * len(tokens), prefill_s, time.perf_counter() - t0)

    # ---------------------------------------------------------------- block verification

    @torch.no_grad()
    def generate_block(self, prompt: list[int], max_new_tokens: int) -> DecodeResult:
        self.drafter.eval()
        cache, context, anchor, prefill_s = self._prefill(prompt)
        dcache = DrafterKVCache(len(self.drafter.layers))
        tokens = [anchor]
        accepts: list[int] = []
        start = len(prompt)
        t0 = time.perf_counter()
        while not self._done(tokens, max_new_tokens):
            draft_logits = self._draft_logits(context, anchor, start, dcache)
            drafts = self._pick(draft_logits)
            block = torch.cat([torch.tensor([anchor], device=self.device), drafts])
            positions = torch.arange(start, start + self.block_size, device=self.device)
            logits, hidden = self._target(block, positions, cache)
            if self.temperature <= 0:
                posterior = logits.argmax(-1)
                agree = (drafts == posterior[:-1]).long().cumprod(0)
                n_acc = int(agree.sum())
                new = drafts[:n_acc].tolist() + [int(posterior[n_acc])]
            else:
                n_acc, bonus = speculative_accept(drafts, draft_logits, logits, self.temperature, self.generator)
                new = drafts[:n_acc].tolist() + [bonus]
            tokens.extend(new)
            accepts.append(n_acc + 1)
            context = hidden[: n_acc + 1]
            start += n_acc + 1
            trim_cache(cache, start)
            anchor = new[-1]
        _sync(self.device)
        return DecodeResult(self._finish(tokens, max_new_tokens), accepts, prefill_s, time.perf_counter() - t0)

    # ---------------------------------------------------------------- DDTree

    @staticmethod
    def build_tree(log_probs: torch.Tensor, budget: int) -> tuple[list[int], list[int], list[int]]:
        """Best-first tree over per-depth candidate lists. `log_probs [D, V]` for depths 1..D.
        Returns (token, parent index or -1 for the root, depth) per node, parents before children."""
        depth_max = log_probs.shape[0]
        k = min(budget, log_probs.shape[1])
        top_lp, top_ids = log_probs.topk(k, dim=-1)
        top_lp, top_ids = top_lp.tolist(), top_ids.tolist()
        tokens, parents, depths = [], [], []
        # heap entries: (-score, parent node, depth (1-based), rank at that depth, parent score)
        heap = [(-top_lp[0][0], -1, 1, 0, 0.0)]
        while heap and len(tokens) < budget:
            neg, parent, depth, rank, parent_score = heapq.heappop(heap)
            node = len(tokens)
            tokens.append(top_ids[depth - 1][rank])
            parents.append(parent)
            depths.append(depth)
            if rank + 1 < k:  # next sibling
                heapq.heappush(heap, (-(parent_score + top_lp[depth - 1][rank + 1]), parent, depth, rank + 1, parent_score))
            if depth < depth_max:  # best child
                heapq.heappush(heap, (-(-neg + top_lp[depth][0]), node, depth + 1, 0, -neg))
        return tokens, parents, depths

    def _tree_mask(self, parents: list[int], past: int, dtype: torch.dtype) -> torch.Tensor:
        n = len(parents) + 1  # root first
        allowed = torch.zeros(n, past + n, dtype=torch.bool)  # built on the CPU: one copy, not n^2 kernels
        allowed[:, :past] = True
        for i in range(n):
            node = i
            while True:
                allowed[i, past + node] = True
                if node == 0:
                    break
                node = parents[node - 1] + 1
        mask = torch.zeros(1, 1, n, past + n, dtype=dtype)
        return mask.masked_fill(~allowed, torch.finfo(dtype).min).to(self.device)

    @torch.no_grad()
    def generate_tree(self, prompt: list[int], max_new_tokens: int, budget: int) -> DecodeResult:
        if self.temperature > 0:
            raise ValueError("DDTree verification is implemented for greedy decoding (temperature 0)")
        self.drafter.eval()
        cache, context, anchor, prefill_s = self._prefill(prompt)
        dcache = DrafterKVCache(len(self.drafter.layers))
        tokens = [anchor]
        accepts: list[int] = []
        start = len(prompt)
        dtype = next(self.target.parameters()).dtype
        t0 = time.perf_counter()
        while not self._done(tokens, max_new_tokens):
            log_probs = torch.log_softmax(self._draft_logits(context, anchor, start, dcache), -1)
            node_tokens, parents, depths = self.build_tree(log_probs, budget)
            ids = torch.tensor([anchor] + node_tokens, device=self.device)
            positions = torch.tensor([start] + [start + d for d in depths], device=self.device)
            mask = self._tree_mask(parents, start, dtype)
            logits, hidden = self._target(ids, positions, cache, mask)
            choice = logits.argmax(-1).tolist()
            children: dict[int, dict[int, int]] = {}
            for i, (tok, par) in enumerate(zip(node_tokens, parents)):
                children.setdefault(par + 1, {}).setdefault(tok, i + 1)
            path, node = [0], 0
            while choice[node] in children.get(node, {}):
                node = children[node][choice[node]]
                path.append(node)
            new = [node_tokens[i - 1] for i in path[1:]] + [choice[node]]
            tokens.extend(new)
            accepts.append(len(new))
            keep = torch.cat([torch.arange(start, device=self.device), start + torch.tensor(path, device=self.device)])
            select_cache(cache, keep)
            context = hidden[torch.tensor(path, device=self.device)]
            start += len(path)
            anchor = new[-1]
        _sync(self.device)
        return DecodeResult(self._finish(tokens, max_new_tokens), accepts, prefill_s, time.perf_counter() - t0)
