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
from transformers.cache_utils import DynamicLayer

from ..architectures.attention import DrafterKVCache, sdpa_attention
from ..architectures.drafter import Drafter
from ..target.hf_model import forward_with_layer_states


@dataclass
class DecodeResult:
    tokens: list[int]  # new tokens, stop token included if one was produced
    accept_lengths: list[int] = field(default_factory=list)  # tokens gained per target forward
    prefill_s: float = 0.0
    decode_s: float = 0.0
    # tokens the target verified per forward (the anchor and the drafts it was given; block decoding only)
    verified_lengths: list[int] = field(default_factory=list)

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


class GrowingLayer(DynamicLayer):
    """A `DynamicLayer` whose keys/values live in a buffer with spare room: a forward writes its new
    positions into the buffer instead of concatenating (`DynamicLayer` copies the whole past of every
    layer on every step: ~6 ms per step on CPU at 700 tokens of context, ~24 ms at 1,500), and
    `keys`/`values` are views of the filled part, so cutting the cache back is free. Anything that
    replaces `keys` with a tensor outside the buffer (e.g. `DynamicLayer.crop` on another version) is
    copied into a fresh buffer at the next update."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._kbuf: Optional[torch.Tensor] = None
        self._vbuf: Optional[torch.Tensor] = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        # what DynamicLayer.lazy_initialization sets (its signature differs between transformers versions)
        self.dtype, self.device, self.is_initialized = key_states.dtype, key_states.device, True
        old_k, old_v = getattr(self, "keys", None), getattr(self, "values", None)
        n = old_k.shape[-2] if old_k is not None and old_k.numel() else 0
        m = n + key_states.shape[-2]
        buf = self._kbuf
        if buf is None or m > buf.shape[-2] or (n and old_k.data_ptr() != buf.data_ptr()) \
                or buf.shape[:-2] != key_states.shape[:-2] or buf.dtype != key_states.dtype:
            cap = max(2 * m, 256)
            self._kbuf = key_states.new_empty(*key_states.shape[:-2], cap, key_states.shape[-1])
            self._vbuf = value_states.new_empty(*value_states.shape[:-2], cap, value_states.shape[-1])
            if n:
                self._kbuf[..., :n, :] = old_k
                self._vbuf[..., :n, :] = old_v
        self._kbuf[..., n:m, :] = key_states
        self._vbuf[..., n:m, :] = value_states
        self.keys, self.values = self._kbuf[..., :m, :], self._vbuf[..., :m, :]
        return self.keys, self.values


def new_cache() -> DynamicCache:
    """An empty target cache whose layers grow in place (`GrowingLayer`), where this transformers
    version builds its `DynamicCache` layers lazily from a class; a plain `DynamicCache` otherwise."""
    cache = DynamicCache()
    if getattr(cache, "layer_class_to_replicate", None) is DynamicLayer and not getattr(cache, "layers", None):
        cache.layer_class_to_replicate = GrowingLayer
    return cache


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


def accept_tree_path(cache: DynamicCache, start: int, path: list[int], path_t: torch.Tensor) -> None:
    """After a tree verification (node i at cache position start + i, the root first), keep positions
    `< start` and the accepted nodes `path` (ascending, path[0] = 0), in that order. Only the accepted
    nodes move (into start.. start + len(path)), in place: no copy of the past (`select_cache` copies it)."""
    n = len(path)
    contiguous = path[-1] == n - 1  # ascending and starting at 0: path == [0, 1, ..., n-1]
    for layer in _cache_layers(cache):
        if getattr(layer, "keys", None) is not None and layer.keys.numel():
            k, v = layer.keys, layer.values
            if not contiguous:
                k[..., start:start + n, :] = k[..., start + path_t, :]  # the gather copies before the write
                v[..., start:start + n, :] = v[..., start + path_t, :]
            layer.keys, layer.values = k[..., :start + n, :], v[..., :start + n, :]


def speculative_accept(
    drafts: torch.Tensor,
    q: torch.Tensor,
    target_logits: torch.Tensor,
    temperature: float,
    generator: torch.Generator,
) -> tuple[int, int]:
    """Speculative sampling over a block: draft i, sampled from `q[i]` (a distribution over the vocabulary,
    which may depend on the drafts before it), is accepted with probability min(1, p_i(d)/q_i(d)); at the first
    rejection the token comes from max(p_i - q_i, 0) normalised; if every draft passes, the bonus comes from
    p_{n}. Outputs follow the target's distribution. `target_logits` has one more row than `drafts`."""
    p = torch.softmax(target_logits / temperature, -1)
    u = torch.rand(len(drafts), generator=generator, device=drafts.device)
    for i, d in enumerate(drafts.tolist()):
        if u[i] > p[i, d] / q[i, d].clamp_min(1e-20):
            residual = (p[i] - q[i]).clamp_min(0)
            residual = residual / residual.sum() if residual.sum() > 0 else p[i]
            return i, int(torch.multinomial(residual, 1, generator=generator))
    return len(drafts), int(torch.multinomial(p[len(drafts)], 1, generator=generator))


def confident_drafts(confidence: torch.Tensor, threshold: float) -> torch.Tensor:
    """Per row of `confidence [..., D]` (each draft's predicted acceptance), the drafts a step truncated at
    `threshold` gives the target: those before the first predicted below it, possibly none. Decoding and replay
    both truncate by this rule."""
    return (confidence >= threshold).long().cumprod(-1).sum(-1)


class SpeculativeDecoder:
    def __init__(
        self,
        target,
        drafter: Drafter,
        stop_token_ids: Optional[list[int]] = None,
        temperature: float = 0.0,
        block_size: Optional[int] = None,
        seed: int = 0,
        confidence_threshold: float = 0.0,
    ):
        """`confidence_threshold` C > 0: block decoding verifies the drafts before the first whose predicted
        acceptance (`Drafter.draft_with_confidence`) is below C (the drafter's own prediction, so still lossless)."""
        if confidence_threshold > 0 and not drafter.has_confidence:
            raise ValueError(f"a confidence threshold needs a drafter with a confidence head; this "
                             f"{drafter.architecture} drafter has none: drop --confidence-threshold")
        self.confidence_threshold = confidence_threshold
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
        params = inspect.signature(target.forward).parameters
        self.cache_kwarg = "cache" if "cache" in params else "past_key_values"
        # Prefill needs the last position's logits only: the lm_head over the whole prompt was ~18% of the
        # prefill on CPU (49,152 x 576 per prompt token).
        self.keep_kwarg = "logits_to_keep" if "logits_to_keep" in params else None

    # ---------------------------------------------------------------- target and drafter calls

    def _target(self, ids: torch.Tensor, positions: torch.Tensor, cache: DynamicCache, mask=None,
                last_only: bool = False):
        """(logits `[Q, V]` float32, captured hidden `[Q, K*H]`); `last_only`: logits of the last position
        only (`[1, V]`)."""
        extra = {self.keep_kwarg: 1} if last_only and self.keep_kwarg else {}
        out, states = forward_with_layer_states(
            self.target,
            input_ids=ids.view(1, -1),
            position_ids=positions.view(1, -1),
            use_cache=True,
            **{self.cache_kwarg: cache},
            attention_mask=mask,
            **extra,
        )
        hidden = torch.cat([states[i + 1] for i in self.layer_ids], dim=-1)[0]
        logits = out.logits[0]
        return (logits[-1:] if last_only else logits).float(), hidden

    def _draft_hidden(self, context: torch.Tensor, anchor: int, start: int, dcache: DrafterKVCache):
        """(the drafter's final hidden states `[1, B, H]` of the block anchored at `start`, the anchor `[1]`)."""
        bs = self.block_size
        block = torch.full((1, bs), self.drafter.mask_token_id, dtype=torch.long, device=self.device)
        block[0, 0] = anchor
        positions = torch.arange(dcache.length(), start + bs, device=self.device).view(1, -1)
        dtype = next(self.drafter.parameters()).dtype
        # The cache holds the keys of positions 0..start-1 (context) and the block sits at start: masks only
        # where a layer has a window or in-block causality (None otherwise: every key visible).
        masks = self.drafter.decode_masks(start, bs, self.device)
        out = self.drafter(context.unsqueeze(0).to(dtype), self.drafter.embed_block(self.embed, block).to(dtype),
                           positions, sdpa_attention, masks, dcache)
        dcache.crop(start)  # keep context keys only
        return out, block[:, 0]

    def _draft(self, context: torch.Tensor, anchor: int, start: int,
               dcache: DrafterKVCache) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(the block's drafts `[num_drafts]`, their distributions `[num_drafts, V]` when sampling, else None); with
        a confidence threshold, only those before the first draft predicted below it (possibly none)."""
        hidden, anchor_t = self._draft_hidden(context, anchor, start, dcache)
        if self.confidence_threshold <= 0:
            drafts, q = self.drafter.draft(hidden, self.lm_head, anchor_t, self.temperature, self.generator)
            return drafts[0], (q[0] if q is not None else None)
        drafts, q, conf = self.drafter.draft_with_confidence(hidden, self.lm_head, anchor_t, self.temperature,
                                                             self.generator)
        keep = int(confident_drafts(conf[0], self.confidence_threshold))
        return drafts[0, :keep], (q[0, :keep] if q is not None else None)

    def _tree_candidates(self, context: torch.Tensor, anchor: int, start: int, dcache: DrafterKVCache, k: int):
        """Per drafted slot its tree candidates (`Drafter.tree_candidates` of this one block: one depth per
        draft)."""
        hidden, anchor_t = self._draft_hidden(context, anchor, start, dcache)
        top_lp, top_ids = self.drafter.tree_candidates(hidden, self.lm_head, anchor_t, k)
        return top_lp[0], top_ids[0]

    def _pick(self, logits: torch.Tensor) -> torch.Tensor:
        if self.temperature <= 0:
            return logits.argmax(-1)
        probs = torch.softmax(logits / self.temperature, -1)
        return torch.multinomial(probs, 1, generator=self.generator).squeeze(-1)

    def _done(self, tokens: list[int], max_new: int, new: Optional[list[int]] = None) -> bool:
        """Enough tokens, or a stop token among `new` (the tokens added since the last check; all when None)."""
        return len(tokens) >= max_new or any(t in self.stop for t in (tokens if new is None else new))

    def _finish(self, tokens: list[int], max_new: int) -> list[int]:
        tokens = tokens[:max_new]
        for i, t in enumerate(tokens):
            if t in self.stop:
                return tokens[: i + 1]
        return tokens

    def _prefill(self, prompt: list[int]):
        cache = new_cache()
        ids = torch.tensor(prompt, device=self.device)
        _sync(self.device)
        t0 = time.perf_counter()
        logits, hidden = self._target(ids, torch.arange(len(prompt), device=self.device), cache, last_only=True)
        first = int(self._pick(logits[-1]))
        _sync(self.device)
        return cache, hidden, first, time.perf_counter() - t0

    # ---------------------------------------------------------------- the target alone

    @torch.no_grad()
    def generate_target_only(self, prompt: list[int], max_new_tokens: int) -> DecodeResult:
        cache, _, token, prefill_s = self._prefill(prompt)
        tokens = [token]
        t0 = time.perf_counter()
        while not self._done(tokens, max_new_tokens, tokens[-1:]):
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
        tokens, new = [anchor], [anchor]
        accepts: list[int] = []
        verified: list[int] = []
        start = len(prompt)
        t0 = time.perf_counter()
        while not self._done(tokens, max_new_tokens, new):
            drafts, q = self._draft(context, anchor, start, dcache)
            block = torch.cat([drafts.new_full((1,), anchor), drafts])
            positions = torch.arange(start, start + len(block), device=self.device)
            logits, hidden = self._target(block, positions, cache)
            if self.temperature <= 0:
                # one device -> host copy per step (each .tolist()/int() is a sync on a GPU)
                both = torch.cat([drafts, logits.argmax(-1)]).tolist()
                d, posterior = both[: len(drafts)], both[len(drafts):]
                n_acc = 0
                while n_acc < len(d) and d[n_acc] == posterior[n_acc]:
                    n_acc += 1
                new = d[:n_acc] + [posterior[n_acc]]
            else:
                n_acc, bonus = speculative_accept(drafts, q, logits, self.temperature, self.generator)
                new = drafts[:n_acc].tolist() + [bonus]
            tokens.extend(new)
            accepts.append(n_acc + 1)
            verified.append(len(block))
            context = hidden[: n_acc + 1]
            start += n_acc + 1
            trim_cache(cache, start)
            anchor = new[-1]
        _sync(self.device)
        return DecodeResult(self._finish(tokens, max_new_tokens), accepts, prefill_s, time.perf_counter() - t0,
                            verified)

    # ---------------------------------------------------------------- DDTree

    @staticmethod
    def build_tree(log_probs: torch.Tensor, budget: int) -> tuple[list[int], list[int], list[int]]:
        """Best-first tree over per-depth candidate lists. `log_probs [D, V]` for depths 1..D.
        Returns (token, parent index or -1 for the root, depth) per node, parents before children."""
        k = min(budget, log_probs.shape[1])
        top_lp, top_ids = log_probs.topk(k, dim=-1)
        return SpeculativeDecoder.build_tree_from_top(top_lp, top_ids, budget)

    @staticmethod
    def build_tree_from_top(top_lp: torch.Tensor, top_ids: torch.Tensor,
                            budget: int) -> tuple[list[int], list[int], list[int]]:
        """The best-first tree of `budget` nodes over each depth's candidates `top_ids [D, k]`: the nodes with the
        highest summed log-probability of their path from the root (a prefix-closed set). `top_lp` holds the
        candidates' log-probabilities, either `[D, k]` (each depth's own distribution, independent of the
        parent: DFlash) or `[D, k, k]` (row p: given candidate p of the depth before as the previous token; depth
        0's row 0 given the anchor: a pairwise model such as a candidate selector). At most `budget` children per node; only the rows of
        the nodes built are read (a tree of 32 nodes reads at most 33 of them)."""
        top_lp = top_lp.detach().cpu()
        ids = top_ids.tolist()
        conditional = top_lp.dim() == 3
        depth_max = top_lp.shape[0]
        orders: dict[tuple[int, int], tuple[list[float], list[int]]] = {}

        def children(depth: int, parent_cand: int) -> tuple[list[float], list[int]]:
            """(log-probabilities, candidate indices) of the children at `depth` (0-based), best first (ties in
            the given order), of a parent that is candidate `parent_cand` of depth - 1 (-1: the root)."""
            key = (depth, max(parent_cand, 0) if conditional else 0)
            if key not in orders:
                row = top_lp[depth, key[1]] if conditional else top_lp[depth]
                values, order = row.sort(descending=True, stable=True)
                orders[key] = (values[:budget].tolist(), order[:budget].tolist())
            return orders[key]

        tokens, parents, depths = [], [], []
        # heap entries: (-score, parent node, depth (1-based), rank among the parent's children, parent score,
        # the parent's candidate index at its depth (-1 for the root))
        heap = [(-children(0, -1)[0][0], -1, 1, 0, 0.0, -1)]
        while heap and len(tokens) < budget:
            neg, parent, depth, rank, parent_score, parent_cand = heapq.heappop(heap)
            lps, cands = children(depth - 1, parent_cand)
            cand = cands[rank]
            node = len(tokens)
            tokens.append(ids[depth - 1][cand])
            parents.append(parent)
            depths.append(depth)
            if rank + 1 < len(cands):  # next sibling
                heapq.heappush(heap, (-(parent_score + lps[rank + 1]), parent, depth, rank + 1, parent_score,
                                      parent_cand))
            if depth < depth_max:  # best child
                heapq.heappush(heap, (-(-neg + children(depth, cand)[0][0]), node, depth + 1, 0, -neg, cand))
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
        self.drafter.check_tree_decoding()
        self.drafter.eval()
        cache, context, anchor, prefill_s = self._prefill(prompt)
        dcache = DrafterKVCache(len(self.drafter.layers))
        tokens, new = [anchor], [anchor]
        accepts: list[int] = []
        start = len(prompt)
        dtype = next(self.target.parameters()).dtype
        t0 = time.perf_counter()
        while not self._done(tokens, max_new_tokens, new):
            top_lp, top_ids = self._tree_candidates(context, anchor, start, dcache, budget)
            node_tokens, parents, depths = self.build_tree_from_top(top_lp, top_ids, budget)
            ids, positions = torch.tensor([[anchor] + node_tokens, [start] + [start + d for d in depths]],
                                          device=self.device)  # one host -> device copy
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
            path_t = torch.tensor(path, device=self.device)
            accept_tree_path(cache, start, path, path_t)
            context = hidden.index_select(0, path_t)
            start += len(path)
            anchor = new[-1]
        _sync(self.device)
        return DecodeResult(self._finish(tokens, max_new_tokens), accepts, prefill_s, time.perf_counter() - t0)
