"""The DFlash2 drafter: DFlash's layers with a block-local dynamic convolution before and after each attention
and MLP sublayer (`family.conv.BlockConv`), and a candidate selector over each slot's top-k logits
(`selector.CandidateSelector`). Parameter names equal the reference format's tensor names
(`layers.{i}.attention_conv.base_kernel`, `candidate_selector.predecessor_codebook`, ...)."""

from __future__ import annotations

import copy
from typing import Optional

import torch
from torch import nn
from transformers import Qwen3Config

from ..drafter import BlockProposals
from ..family.model import BlockDrafter
from ..family.conv import ConvDecoderLayer, reset_convs
from .selector import CandidateSelector, Codebooks


class DFlash2Drafter(BlockDrafter):
    architecture = "dflash2"
    layer_class = ConvDecoderLayer

    def __init__(self, config: Qwen3Config):
        super().__init__(config)
        d = config.dflash_config
        self.selector_top_k = int(d["selector_top_k"])
        self.candidate_selector = CandidateSelector(config.vocab_size, config.hidden_size, int(d["selector_rank"]),
                                                    self.selector_top_k, d.get("selector_codebooks", "free"))
        self.candidate_selector.reset_parameters(config.initializer_range)

    @property
    def export_needs_target_head(self) -> bool:
        return self.candidate_selector.factored

    @torch.no_grad()
    def materialized(self, head_weight: torch.Tensor) -> "DFlash2Drafter":
        """This drafter in the reference layout: itself when its selector's codebooks are free tables, else a
        copy whose free tables are the factored codebooks computed from the target's lm_head weight (float32)."""
        if not self.candidate_selector.factored:
            return self
        sel = self.candidate_selector
        device, dtype = sel.hidden_projection.weight.device, sel.hidden_projection.weight.dtype
        predecessor, successor = sel.codebooks(head_weight.to(device=device, dtype=torch.float32))
        config = copy.deepcopy(self.config)
        config.dflash_config.pop("selector_codebooks")
        with torch.device("meta"):
            out = type(self)(config)
        state = {k: v.clone() for k, v in self.state_dict().items()
                 if not k.startswith(("candidate_selector.predecessor_projection.", "candidate_selector.successor_projection."))}
        state["candidate_selector.predecessor_codebook"] = predecessor.to(dtype)
        state["candidate_selector.successor_codebook"] = successor.to(dtype)
        out.load_state_dict(state, strict=True, assign=True)
        out.rotary = copy.deepcopy(self.rotary)  # its tables are buffers outside the state dict
        return out.train(self.training)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        super().reset_parameters()  # every Linear N(0, std), norms 1: then the identity starts
        reset_convs(self)
        if hasattr(self, "candidate_selector"):  # BlockDrafter's constructor calls this before the selector exists
            self.candidate_selector.reset_parameters(self.config.initializer_range)

    def _slot_logits(self, hidden: torch.Tensor, lm_head: nn.Module) -> torch.Tensor:
        """Unary scores `[n, bs-1, V]` (float32) of slots 1.. of blocks `[n, bs, H]`."""
        return self.logits(hidden, lm_head)[:, 1:].float()

    def draft(self, hidden: torch.Tensor, lm_head: nn.Module, anchor_ids: torch.Tensor, temperature: float = 0.0,
              generator: Optional[torch.Generator] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The selector's path (see `Drafter.draft`); when sampling, q is the candidate distribution each draft was
        drawn from, scattered over the vocabulary (zero outside the k candidates)."""
        codebooks = self.candidate_selector.decode_codebooks(lm_head.weight)
        logits = self._slot_logits(hidden, lm_head)
        return self._path(self._candidates(logits), codebooks, hidden, anchor_ids, temperature, generator)

    def _candidates(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(unary scores, ids) `[n, bs-1, k]` of each slot's `selector_top_k` best tokens, best first."""
        return logits.topk(min(self.selector_top_k, logits.shape[-1]), dim=-1)

    def _path(self, candidates: tuple[torch.Tensor, torch.Tensor], codebooks: Codebooks, hidden: torch.Tensor,
              anchor_ids: torch.Tensor, temperature: float = 0.0, generator: Optional[torch.Generator] = None):
        unary, cand = candidates
        tokens, _, dists = self.candidate_selector.walk(unary, cand, hidden[:, 1:], anchor_ids, temperature, generator,
                                                        codebooks)
        if dists is None:
            return tokens, None
        q = dists.new_zeros(*dists.shape[:-1], self.config.vocab_size).scatter_(-1, cand, dists)
        return tokens, q

    def tree_candidates(self, hidden: torch.Tensor, lm_head: nn.Module, anchor_ids: torch.Tensor,
                        k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Each slot's `max(k, selector_top_k)` best unary tokens `[n, bs-1, k]` and their log-probabilities given
        each candidate of the slot before as the previous token `[n, bs-1, k, k]` (slot 1's rows all given the
        anchor): the selector's candidates (the first `selector_top_k`) share the unary probability mass they hold,
        redistributed by softmax(S) given the predecessor; the others keep their unary probability. So each branch
        is scored with its own predecessor, the tree's first branch is the selector's greedy path, and with the
        identity selector (S = U) the tree is DFlash's."""
        codebooks = self.candidate_selector.decode_codebooks(lm_head.weight)
        return self._tree(self._slot_logits(hidden, lm_head), codebooks, hidden, anchor_ids, k)

    def greedy_proposals(self, hidden: torch.Tensor, lm_head: nn.Module, anchor_ids: torch.Tensor,
                         k: int = 0) -> BlockProposals:
        """`draft`'s greedy path, the unary argmax beside it (the first candidate) and, with `k > 0`,
        `tree_candidates(k)` from one product with the head (and one decoding of the selector's codebooks)."""
        logits = self._slot_logits(hidden, lm_head)
        codebooks = self.candidate_selector.decode_codebooks(lm_head.weight)
        candidates = self._candidates(logits)
        drafts = self._path(candidates, codebooks, hidden, anchor_ids)[0]
        top_lp, top_ids = self._tree(logits, codebooks, hidden, anchor_ids, k) if k else (None, None)
        return BlockProposals(drafts, top_lp, top_ids, argmax=candidates[1][..., 0])

    def _tree(self, logits: torch.Tensor, codebooks: Codebooks, hidden: torch.Tensor, anchor_ids: torch.Tensor,
              k: int) -> tuple[torch.Tensor, torch.Tensor]:
        k = max(min(k, logits.shape[-1]), self.selector_top_k)
        top_lp, cand = torch.log_softmax(logits, -1).topk(k, dim=-1)  # [n, T, k]
        c = self.selector_top_k
        unary = logits.gather(-1, cand[..., :c])  # [n, T, c]: the selector's candidates' unary scores U
        n, steps, _ = cand.shape
        previous = torch.cat([anchor_ids.view(-1, 1, 1).expand(n, 1, k), cand[:, :-1]], 1)  # [n, T, k parents]
        scores = self.candidate_selector.scores_given_each(unary, hidden[:, 1:], previous, cand[..., :c],
                                                           codebooks)  # [n, T, k, c]
        mass = top_lp[..., :c].logsumexp(-1, keepdim=True).unsqueeze(-1)  # [n, T, 1, 1]
        lp = top_lp.unsqueeze(2).expand(n, steps, k, k).clone()
        lp[..., :c] = torch.log_softmax(scores, -1) + mass
        return lp, cand
