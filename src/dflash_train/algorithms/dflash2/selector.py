"""DFlash2's candidate selector: per drafted slot, the top-k candidates of its unary logits U, re-scored by a
low-rank bilinear term between the previous token (`a`) and each candidate (`b`):

    S_t(a, b) = U_t(b) + < predecessor[a] * hidden_projection(h_t), successor[b] >

with `h_t` the drafter's final normed hidden state of slot t. Decoding walks the block left to right from the
anchor (the predecessor of slot 1), taking the argmax of S (greedy) or sampling softmax(S / T) over the k
candidates. With `successor = 0` (the identity start) S = U and the walk is the per-slot argmax of DFlash.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn


class CandidateSelector(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, rank: int, top_k: int):
        super().__init__()
        self.rank, self.top_k = rank, top_k
        # Raw parameters, not nn.Embedding: the reference format stores them without a `.weight` suffix.
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)

    @torch.no_grad()
    def reset_parameters(self, std: float) -> None:
        """The identity start: the successor codebook is zero, so every pair term is 0 and S = U."""
        self.predecessor_codebook.normal_(0.0, std)
        self.successor_codebook.zero_()
        self.hidden_projection.weight.normal_(0.0, std)

    def scores(self, unary: torch.Tensor, hidden: torch.Tensor, previous: torch.Tensor,
               candidates: torch.Tensor) -> torch.Tensor:
        """S `[..., k]` (float32, or float64 for float64 inputs) of `candidates [..., k]` with unary scores
        `unary [..., k]`, after `previous [...]`, for slots with final hidden states `hidden [..., H]`."""
        return self.scores_given_each(unary, hidden, previous.unsqueeze(-1), candidates).squeeze(-2)

    def scores_given_each(self, unary: torch.Tensor, hidden: torch.Tensor, previous: torch.Tensor,
                          candidates: torch.Tensor) -> torch.Tensor:
        """`scores` of `candidates [..., k]` after each of `previous [..., P]`: `[..., P, k]` (the hidden
        projection and the candidates' codebook rows computed once for all P predecessors)."""
        acc = torch.promote_types(hidden.dtype, torch.float32)
        z = self.hidden_projection(hidden).to(acc)  # [..., R]
        pred = self.predecessor_codebook[previous].to(acc) * z.unsqueeze(-2)  # [..., P, R]
        succ = self.successor_codebook[candidates].to(acc)  # [..., k, R]
        return unary.to(acc).unsqueeze(-2) + pred @ succ.transpose(-1, -2)

    def walk(self, unary: torch.Tensor, candidates: torch.Tensor, hidden: torch.Tensor, first_previous: torch.Tensor,
             temperature: float = 0.0, generator: Optional[torch.Generator] = None):
        """The selector's path through `n` blocks: `unary`, `candidates [n, T, k]`, `hidden [n, T, H]` of slots
        1..T, `first_previous [n]` (the anchors). Returns (tokens `[n, T]`, the index of each chosen candidate
        `[n, T]`, and with `temperature > 0` the distribution over the candidates each token was sampled from
        `[n, T, k]`, else None)."""
        n, steps, _ = unary.shape
        previous = first_previous
        tokens, chosen, dists = [], [], []
        for t in range(steps):
            s = self.scores(unary[:, t], hidden[:, t], previous, candidates[:, t])  # [n, k]
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
