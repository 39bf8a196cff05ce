"""DFlash2's candidate selector: per drafted slot, the top-k candidates of its unary logits U, re-scored by a
low-rank bilinear term between the previous token (`a`) and each candidate (`b`):

    S_t(a, b) = U_t(b) + < predecessor[a] * hidden_projection(h_t), successor[b] >

with `h_t` the drafter's final normed hidden state of slot t. Decoding walks the block left to right from the
anchor (the predecessor of slot 1), taking the argmax of S (greedy) or sampling softmax(S / T) over the k
candidates. With `successor = 0` (the identity start) S = U and the walk is the per-slot argmax of DFlash.

The two codebooks `[vocab, rank]` are either free tables (`free`, the reference's layout and how it is served) or
`factored` through the target's lm_head rows E: `predecessor = E @ predecessor_projection.T / rms(E)`, the same
for `successor`, with two `[rank, hidden]` projections as the trained weights. A free table row moves only when its
token occurs, by a whole AdamW step each time, so the table memorises the training pairs; the factored codebooks
share every update across tokens whose lm_head rows are alike (measured: free tables' tau, not more;
docs/results/quality.md). Exported drafters always carry free tables (`materialized`: the factored ones computed once from E).
"""

from __future__ import annotations

from typing import Literal, Optional

import torch
from torch import nn

Codebooks = tuple[torch.Tensor, torch.Tensor]  # (predecessor, successor), each [vocab, rank]
CodebookKind = Literal["free", "factored"]


def head_scale(head_weight: torch.Tensor) -> float:
    """1 / the root-mean-square of the lm_head's entries: the factored codebooks project the rows at unit scale,
    so the projections' scale does not depend on the target's. Summed in float32 row chunks (no float32 copy of
    a large head)."""
    acc = torch.promote_types(head_weight.dtype, torch.float32)
    total = sum(float(rows.to(acc).pow(2).sum()) for rows in head_weight.detach().split(8192))
    return (head_weight.numel() / max(total, 1e-24)) ** 0.5


def _tensor_key(t: torch.Tensor) -> tuple:
    """What identifies a tensor's current values for a cache: its storage, in-place version, shape and dtype."""
    return t.data_ptr(), t._version, tuple(t.shape), t.dtype


class CandidateSelector(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, rank: int, top_k: int, codebooks: CodebookKind = "free"):
        super().__init__()
        if codebooks not in ("free", "factored"):
            raise ValueError(f"selector codebooks must be free or factored (got {codebooks!r})")
        self.vocab_size, self.rank, self.top_k, self.kind = vocab_size, rank, top_k, codebooks
        if codebooks == "free":
            # Raw parameters, not nn.Embedding: the reference format stores them without a `.weight` suffix.
            self.predecessor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
            self.successor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        else:
            self.predecessor_projection = nn.Linear(hidden_size, rank, bias=False)
            self.successor_projection = nn.Linear(hidden_size, rank, bias=False)
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)
        self._decode_cache: Optional[tuple[tuple, tuple[torch.Tensor, ...], Codebooks]] = None
        self._scale_cache: Optional[tuple[tuple, float]] = None

    @property
    def factored(self) -> bool:
        return self.kind == "factored"

    @torch.no_grad()
    def reset_parameters(self, std: float) -> None:
        """The identity start: the successor codebook is zero, so every pair term is 0 and S = U. The predecessor
        codebook's entries are N(0, std) either way (a factored projection's `std / sqrt(hidden)` over features of
        unit scale gives that)."""
        if self.factored:
            hidden = self.predecessor_projection.in_features
            self.predecessor_projection.weight.normal_(0.0, std / hidden ** 0.5)
            self.successor_projection.weight.zero_()
        else:
            self.predecessor_codebook.normal_(0.0, std)
            self.successor_codebook.zero_()
        self.hidden_projection.weight.normal_(0.0, std)

    def codebooks(self, head_weight: Optional[torch.Tensor] = None) -> Codebooks:
        """(predecessor, successor) `[vocab, rank]`: the free tables, or the factored ones computed from the
        target's lm_head weight `[vocab, hidden]` (in the graph: gradients reach the projections)."""
        if not self.factored:
            return self.predecessor_codebook, self.successor_codebook
        if head_weight is None or tuple(head_weight.shape) != (self.vocab_size, self.predecessor_projection.in_features):
            raise ValueError(f"factored selector codebooks are computed from the target's lm_head weight "
                             f"[{self.vocab_size}, {self.predecessor_projection.in_features}]; got "
                             f"{None if head_weight is None else tuple(head_weight.shape)}")
        scale = self._head_scale(head_weight)
        pred, succ = (p.weight * scale for p in (self.predecessor_projection, self.successor_projection))
        # The matmul in the head's dtype (a float32 copy of an 8B target's head would be 2.5 GB per step), the
        # tables in float32 at least: their gradients sum over every row that gathers them.
        acc = torch.promote_types(head_weight.dtype, torch.float32)
        return (nn.functional.linear(head_weight, pred.to(head_weight.dtype)).to(acc),
                nn.functional.linear(head_weight, succ.to(head_weight.dtype)).to(acc))

    def _head_scale(self, head_weight: torch.Tensor) -> float:
        """`head_scale`, once per head (the lm_head is frozen; its tensor version keys the cache)."""
        key = _tensor_key(head_weight)
        if self._scale_cache is None or self._scale_cache[0] != key:
            self._scale_cache = (key, head_scale(head_weight))
        return self._scale_cache[1]

    def decode_codebooks(self, head_weight: torch.Tensor) -> Codebooks:
        """`codebooks` for decoding (no graph): factored ones are computed once and reused until the lm_head (its
        tensor version: it is frozen) or a projection's values change. The projections are compared by value with
        the copies the tables were made from: a fused optimizer step updates them in place without bumping their
        tensor versions."""
        if not self.factored or torch.is_grad_enabled():
            return self.codebooks(head_weight)
        weights = (self.predecessor_projection.weight, self.successor_projection.weight)
        cached = self._decode_cache
        if (cached is None or cached[0] != _tensor_key(head_weight)
                or not all(torch.equal(then, now) for then, now in zip(cached[1], weights))):
            cached = (_tensor_key(head_weight), tuple(w.detach().clone() for w in weights), self.codebooks(head_weight))
            self._decode_cache = cached
        return cached[2]

    def scores(self, unary: torch.Tensor, hidden: torch.Tensor, previous: torch.Tensor,
               candidates: torch.Tensor, codebooks: Optional[Codebooks] = None) -> torch.Tensor:
        """S `[..., k]` (float32, or float64 for float64 inputs) of `candidates [..., k]` with unary scores
        `unary [..., k]`, after `previous [...]`, for slots with final hidden states `hidden [..., H]`.
        `codebooks`: from `codebooks()` (needed when factored)."""
        return self.scores_given_each(unary, hidden, previous.unsqueeze(-1), candidates, codebooks).squeeze(-2)

    def scores_given_each(self, unary: torch.Tensor, hidden: torch.Tensor, previous: torch.Tensor,
                          candidates: torch.Tensor, codebooks: Optional[Codebooks] = None) -> torch.Tensor:
        """`scores` of `candidates [..., k]` after each of `previous [..., P]`: `[..., P, k]` (the hidden
        projection and the candidates' codebook rows computed once for all P predecessors)."""
        predecessor, successor = codebooks if codebooks is not None else self.codebooks()
        acc = torch.promote_types(hidden.dtype, torch.float32)
        z = self.hidden_projection(hidden).to(acc)  # [..., R]
        pred = predecessor[previous].to(acc) * z.unsqueeze(-2)  # [..., P, R]
        succ = successor[candidates].to(acc)  # [..., k, R]
        return unary.to(acc).unsqueeze(-2) + pred @ succ.transpose(-1, -2)

    def walk(self, unary: torch.Tensor, candidates: torch.Tensor, hidden: torch.Tensor, first_previous: torch.Tensor,
             temperature: float = 0.0, generator: Optional[torch.Generator] = None,
             codebooks: Optional[Codebooks] = None):
        """The selector's path through `n` blocks: `unary`, `candidates [n, T, k]`, `hidden [n, T, H]` of slots
        1..T, `first_previous [n]` (the anchors). Returns (tokens `[n, T]`, the index of each chosen candidate
        `[n, T]`, and with `temperature > 0` the distribution over the candidates each token was sampled from
        `[n, T, k]`, else None)."""
        n, steps, _ = unary.shape
        previous = first_previous
        tokens, chosen, dists = [], [], []
        for t in range(steps):
            s = self.scores(unary[:, t], hidden[:, t], previous, candidates[:, t], codebooks)  # [n, k]
            if temperature <= 0:
                idx = s.argmax(-1)
            else:
                q = torch.softmax(s / temperature, -1)
                idx = torch.multinomial(q, 1, generator=generator).squeeze(-1)
                dists.append(q)
            previous = candidates[:, t].gather(1, idx.unsqueeze(1)).squeeze(1)
            tokens.append(previous)
            chosen.append(idx)
        return torch.stack(tokens, 1), torch.stack(chosen, 1), (torch.stack(dists, 1) if dists else None)
