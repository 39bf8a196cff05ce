"""The DSpark drafter: the family's block drafter (`BlockDrafter`), whose block of B slots predicts B tokens (slot k
the token after position a + k), with a Markov head that adds to slot k's base logits `lm_head(h_k)` a bias from the token
before it, and a confidence head whose logit predicts the slot's acceptance given the slots before it were accepted.

Markov head (rank r, tables `markov_w1 [V, r]`, `markov_w2 [V, r]`): slot k's feature `f_k` gives the bias
`markov_w2(f_k)`, from `e_k = markov_w1[x_{k-1}]` (x_{-1} the anchor):
  - vanilla: `f_k = e_k`;
  - gated: `f_k = sigmoid(gate_proj([h_k; e_k])) * e_k`;
  - rnn: `(g, c, o) = joint_proj([s_{k-1}; e_k; h_k])`, `s_k = sigmoid(g) s_{k-1} + (1 - sigmoid(g)) tanh(c)`
    (`s_{-1} = 0`), `f_k = tanh(o)`.
Confidence head: `proj([h_k; e_k])` (or `proj(h_k)`), a logit. Parameter names are the export's tensor names.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn
from transformers import Qwen3Config

from ..drafter import BlockProposals
from ..family.model import BlockDrafter
from .options import tree_refusal


class MarkovHead(nn.Module):
    def __init__(self, vocab: int, hidden: int, rank: int, kind: str):
        super().__init__()
        self.kind, self.rank = kind, rank
        self.markov_w1 = nn.Embedding(vocab, rank)
        self.markov_w2 = nn.Linear(rank, vocab, bias=False)
        if kind == "gated":
            self.gate_proj = nn.Linear(hidden + rank, rank)
        elif kind == "rnn":
            self.joint_proj = nn.Linear(2 * rank + hidden, 3 * rank)
        elif kind != "vanilla":
            raise ValueError(f"markov_head_type must be vanilla, gated or rnn (got {kind!r})")

    def step(self, h: torch.Tensor, prev_ids: torch.Tensor, state: Optional[torch.Tensor]):
        """One slot: (feature `[..., r]`, the previous token's embedding, the next state (rnn; else None))."""
        e = self.markov_w1(prev_ids).to(h.dtype)
        if self.kind == "vanilla":
            return e, e, None
        if self.kind == "gated":
            return torch.sigmoid(self.gate_proj(torch.cat([h, e], -1))) * e, e, None
        if state is None:
            state = h.new_zeros(*h.shape[:-1], self.rank)
        g, c, o = self.joint_proj(torch.cat([state, e, h], -1)).chunk(3, -1)
        gate = torch.sigmoid(g)
        return torch.tanh(o), e, gate * state + (1 - gate) * torch.tanh(c)

    def features(self, h: torch.Tensor, prev_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every slot's feature and previous-token embedding, `[..., bs, r]` each, from `h [..., bs, H]` and the
        slots' previous tokens `[..., bs]` (teacher-forced in training). The rnn unrolls over the bs slots (a
        fixed Python loop: no data-dependent control flow)."""
        if self.kind != "rnn":
            f, e, _ = self.step(h, prev_ids, None)
            return f, e
        state, fs, es = None, [], []
        for k in range(h.shape[-2]):
            f, e, state = self.step(h[..., k, :], prev_ids[..., k], state)
            fs.append(f)
            es.append(e)
        return torch.stack(fs, -2), torch.stack(es, -2)

    def bias(self, feature: torch.Tensor) -> torch.Tensor:
        return self.markov_w2(feature.to(self.markov_w2.weight.dtype)).float()


class ConfidenceHead(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.proj = nn.Linear(width, 1)

    def forward(self, h: torch.Tensor, e: Optional[torch.Tensor]) -> torch.Tensor:
        x = h if e is None else torch.cat([h, e.to(h.dtype)], -1)
        return self.proj(x.to(self.proj.weight.dtype)).squeeze(-1).float()


class DSparkDrafter(BlockDrafter):
    architecture = "dspark"

    def __init__(self, config: Qwen3Config):
        super().__init__(config)
        self.markov_rank = int(config.markov_rank)
        self.markov_head_type = str(config.markov_head_type)
        self.with_confidence = bool(config.enable_confidence_head)
        self.confidence_with_markov = bool(config.confidence_head_with_markov) and self.markov_rank > 0
        if self.markov_rank:
            self.markov_head = MarkovHead(config.vocab_size, config.hidden_size, self.markov_rank,
                                          self.markov_head_type)
        if self.with_confidence:
            width = config.hidden_size + (self.markov_rank if self.confidence_with_markov else 0)
            self.confidence_head = ConfidenceHead(width)
        self.reset_parameters()  # again, now that the heads exist

    @torch.no_grad()
    def reset_parameters(self) -> None:
        super().reset_parameters()
        if getattr(self, "markov_rank", 0):
            self.markov_head.markov_w1.weight.normal_(0.0, self.config.initializer_range)

    def markov(self, h: torch.Tensor, prev_ids: torch.Tensor) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """(features, previous-token embeddings) `[..., bs, r]`, both None without a Markov head."""
        if not self.markov_rank:
            return None, None
        return self.markov_head.features(h, prev_ids)

    def confidence(self, h: torch.Tensor, e: Optional[torch.Tensor]) -> torch.Tensor:
        return self.confidence_head(h, e if self.confidence_with_markov else None)

    def sequential_logits(self, hidden: torch.Tensor, lm_head: nn.Module, anchor_ids: torch.Tensor, choose,
                          base: Optional[torch.Tensor] = None
                          ) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        """Decode the block slot by slot: slot k's logits are its base logits (`base`, else computed here) plus the
        Markov bias of the token chosen at slot k - 1 (the anchor for k = 0); `choose(logits [n, V]) -> ids [n]`.
        Returns (ids `[n, bs]`, corrected logits `[n, bs, V]`, confidence logits `[n, bs]` or None)."""
        if base is None:
            base = self.logits(hidden, lm_head)
        prev, state, ids, logits, conf = anchor_ids, None, [], [], []
        for k in range(hidden.shape[1]):
            h = hidden[:, k]
            z = base[:, k]
            e = None
            if self.markov_rank:
                f, e, state = self.markov_head.step(h, prev, state)
                z = z + self.markov_head.bias(f)
            if self.with_confidence:
                conf.append(self.confidence(h, e))
            prev = choose(z)
            ids.append(prev)
            logits.append(z)
        return torch.stack(ids, 1), torch.stack(logits, 1), (torch.stack(conf, 1) if conf else None)

    def num_drafts(self, block_size: Optional[int] = None) -> int:
        """Every slot drafts (the anchor is the first prediction): bs speculative tokens per block."""
        return block_size or self.block_size

    @property
    def has_confidence(self) -> bool:
        return self.with_confidence

    def _drafts(self, hidden, lm_head, anchor_ids, temperature: float, generator):
        if temperature <= 0:
            ids, _, conf = self.sequential_logits(hidden, lm_head, anchor_ids, lambda z: z.argmax(-1))
            return ids, None, conf

        def sample(z):
            return torch.multinomial(torch.softmax(z / temperature, -1), 1, generator=generator).squeeze(1)

        ids, logits, conf = self.sequential_logits(hidden, lm_head, anchor_ids, sample)
        return ids, torch.softmax(logits / temperature, -1), conf

    def draft(self, hidden, lm_head, anchor_ids, temperature: float = 0.0, generator=None):
        """Drafts of all bs slots (the decoder verifies the anchor and bs drafts), each slot's Markov bias from the
        token drafted before it; with `temperature > 0` sampled from `q = softmax(corrected logits / T)`, returned
        for speculative sampling."""
        ids, q, _ = self._drafts(hidden, lm_head, anchor_ids, temperature, generator)
        return ids, q

    def draft_with_confidence(self, hidden, lm_head, anchor_ids, temperature: float = 0.0, generator=None):
        """`draft`'s and each slot's `sigmoid(confidence logit)`, from its hidden state and the token drafted
        before it (the drafter's own: non-anticipating)."""
        if not self.with_confidence:
            raise ValueError("--confidence-threshold: this DSpark drafter has no confidence head "
                             "(dspark.confidence_head=false); evaluate it without the option")
        ids, q, conf = self._drafts(hidden, lm_head, anchor_ids, temperature, generator)
        return ids, q, torch.sigmoid(conf)

    def check_tree_decoding(self) -> None:
        why = tree_refusal({"markov_rank": self.markov_rank, "markov_head_type": self.markov_head_type})
        if why:
            raise ValueError(why)

    def tree_candidates(self, hidden, lm_head, anchor_ids, k: int, max_elements: int = 1 << 26):
        """DDTree candidates of all bs slots (depth d: slot d, depth 0 given the anchor). A vanilla or gated
        Markov bias depends only on the token before the slot (and the slot's own hidden state), so every
        (parent, child) pair is scored exactly: `[n, bs, k, k]`, row p the log-probabilities
        `log_softmax(base_d + bias(candidate p of depth d - 1))` at depth d's candidates, which are the `k` best
        given depth d - 1's best candidate (so the tree's first branch is the greedy block draft). Without a
        Markov head each slot is independent (`[n, bs, k]`). Rows of blocks in chunks of at most `max_elements`
        scores at once."""
        self.check_tree_decoding()
        return self._tree(self.logits(hidden, lm_head), hidden, anchor_ids, k, max_elements)

    def greedy_proposals(self, hidden: torch.Tensor, lm_head: nn.Module, anchor_ids: torch.Tensor,
                         k: int = 0) -> BlockProposals:
        """Greedy drafts, with `k > 0` `tree_candidates(k)`, and the confidence head's predictions (where it has
        one), from one product with the head."""
        if k:
            self.check_tree_decoding()
        base = self.logits(hidden, lm_head)  # [n, bs, V]
        ids, _, conf = self.sequential_logits(hidden, lm_head, anchor_ids, lambda z: z.argmax(-1), base)
        top_lp, top_ids = self._tree(base, hidden, anchor_ids, k) if k else (None, None)
        return BlockProposals(ids, top_lp, top_ids, None if conf is None else torch.sigmoid(conf))

    def _tree(self, base: torch.Tensor, hidden: torch.Tensor, anchor_ids: torch.Tensor, k: int,
              max_elements: int = 1 << 26) -> tuple[torch.Tensor, torch.Tensor]:
        n, depth, vocab = base.shape
        k = min(k, vocab)
        if not self.markov_rank:
            return torch.log_softmax(base, -1).topk(k, dim=-1)
        rows = max(1, max_elements // (k * vocab))
        parts = [self._conditional_candidates(base[i:i + rows], hidden[i:i + rows], anchor_ids[i:i + rows], k)
                 for i in range(0, n, rows)]
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])

    def _conditional_candidates(self, base: torch.Tensor, hidden: torch.Tensor, anchor_ids: torch.Tensor, k: int):
        n, depth, _ = base.shape
        parents = anchor_ids.view(n, 1)  # [n, P]: depth 0's one parent, then the k candidates before
        log_probs, ids = [], []
        for d in range(depth):
            h = hidden[:, d:d + 1].expand(n, parents.shape[1], hidden.shape[-1])
            feature, _, _ = self.markov_head.step(h, parents, None)
            lp = torch.log_softmax(base[:, d:d + 1] + self.markov_head.bias(feature), -1)  # [n, P, V]
            cand = lp[:, 0].topk(k, dim=-1).indices  # [n, k], given the best (first) parent
            scored = lp.gather(-1, cand.unsqueeze(1).expand(n, lp.shape[1], k))  # [n, P, k]
            log_probs.append(scored.expand(n, k, k))  # depth 0: its one row for every p
            ids.append(cand)
            parents = cand
        return torch.stack(log_probs, 1), torch.stack(ids, 1)
