"""The drafter as the generic stack holds it: what training, decoding, replay, evaluation and export read off any
architecture's drafter or call on it, and nothing else. The block drafters this repository ships implement it in
`family.model.BlockDrafter`."""

from __future__ import annotations

import abc
from typing import Any, Callable, NamedTuple, Optional

import torch
from torch import nn


def default_target_layer_ids(num_target_layers: int, num_ids: int) -> list[int]:
    """The reference rule: one id -> the middle layer; else evenly from layer 1 to L - 3."""
    if num_ids == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    return [int(round(start + i * (end - start) / (num_ids - 1))) for i in range(num_ids)]


class BlockProposals(NamedTuple):
    """A drafter's greedy proposals for `n` blocks (`Drafter.greedy_proposals`): drafts `[n, D]`, the DDTree
    candidates' log-probabilities (`[n, D, k]` or `[n, D, k, k]`) and target ids `[n, D, k]` when asked for,
    each draft's predicted acceptance `[n, D]` from a drafter with a confidence head, and, from a drafter whose
    drafts rerank its backbone's candidates (a selector, a lattice walk), the backbone's own argmax at
    each slot `[n, D]`: what it would draft without the reranker."""

    drafts: torch.Tensor
    top_lp: Optional[torch.Tensor] = None
    top_ids: Optional[torch.Tensor] = None
    confidence: Optional[torch.Tensor] = None
    argmax: Optional[torch.Tensor] = None


class Drafter(nn.Module, metaclass=abc.ABCMeta):
    """The attributes generic code reads off any architecture's drafter (set by its constructor): `config` (the
    exported config), `block_size`, `mask_token_id`, `target_layer_ids` and `layers` (a KV cache entry per layer).
    Its forward maps (target features `[b, S, K*H]`, block embeddings `[b, Q, H]` (`embed_block`), position ids
    `[b, S + Q]`, attention fn, mask[, cache]) to the block's final hidden states `[b, Q, H]`, which `draft`,
    `tree_candidates` and `greedy_proposals` turn into proposals (target ids)."""

    architecture: str  # its `drafter.architecture` name (the registry's key)
    config: Any
    block_size: int
    mask_token_id: int
    target_layer_ids: list[int]
    layers: nn.ModuleList

    # ------------------------------------------------------------ the forward's inputs

    @abc.abstractmethod
    def embed_block(self, embed: Callable[[torch.Tensor], torch.Tensor], block_ids: torch.Tensor) -> torch.Tensor:
        """The block's input embeddings (anchor and mask tokens) through the target's embedding `embed`: every path
        that forms block inputs (training, decoding, replay) calls this, so they agree."""

    @abc.abstractmethod
    def dense_masks(self, anchors: torch.Tensor, keep: torch.Tensor, context_len: int) -> object:
        """The training layout's dense masks for blocks at `anchors` `[b, N]` (`keep`: which are real), in the form
        `forward`'s `mask` takes (replay runs the layout on the CPU)."""

    @abc.abstractmethod
    def decode_masks(self, context_len: int, block_size: int, device: torch.device) -> Optional[dict]:
        """Masks for decoding with a KV cache (keys: the `context_len` positions before the block, then the block
        of `block_size` at position `context_len`): None when the layout alone needs none."""

    def compile_layers(self, backend: Optional[str] = None) -> None:
        """`drafter.compile`: compile the layers for the training step."""
        raise ValueError(f"drafter.compile: the {self.architecture} drafter has no compiled layers; set "
                         "drafter.compile=false")

    # ------------------------------------------------------------ proposals

    @abc.abstractmethod
    def num_drafts(self, block_size: Optional[int] = None) -> int:
        """Tokens one block of `block_size` slots (the trained block size by default) drafts: the number of
        speculative tokens a serving engine must be set to, and what `draft` returns per block."""

    @abc.abstractmethod
    def draft(self, hidden: torch.Tensor, lm_head: nn.Module, anchor_ids: torch.Tensor, temperature: float = 0.0,
              generator: Optional[torch.Generator] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The drafts `[n, num_drafts]` (target ids) of `n` blocks from their final hidden states `[n, bs, H]`
        (`anchor_ids [n]`: each block's anchor), through the target's `lm_head`: greedy, or with `temperature > 0`
        sampled, their distributions `q` over the target's vocabulary returned too for speculative sampling."""

    @abc.abstractmethod
    def tree_candidates(self, hidden: torch.Tensor, lm_head: nn.Module, anchor_ids: torch.Tensor,
                        k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Each drafted slot's candidate next tokens (target ids, `[n, D, k]`, D = `num_drafts()`: the tree's
        depth) and their log-probabilities for a DDTree over the block (`SpeculativeDecoder.build_tree_from_top`):
        `[n, D, k]` when each slot's distribution is its own, or `[n, D, k, k]` when it depends on the token before
        (row p: given candidate p of the depth before; depth 0's rows given the anchor)."""

    def check_tree_decoding(self) -> None:
        """Raise a user error (ValueError naming --tree-budget) where this drafter cannot give DDTree candidates;
        decoding calls it before the first prompt. Every drafter can, unless it says otherwise."""

    @property
    def has_confidence(self) -> bool:
        """Whether the drafter predicts each draft's acceptance (`draft_with_confidence`), which decoding can use
        to verify fewer drafts (`eval --confidence-threshold`)."""
        return False

    def draft_with_confidence(self, hidden: torch.Tensor, lm_head: nn.Module, anchor_ids: torch.Tensor,
                              temperature: float = 0.0, generator: Optional[torch.Generator] = None
                              ) -> tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor]:
        """`draft`'s (drafts, q) and each draft's predicted acceptance probability `[n, num_drafts]` (given the
        drafts before it were accepted), computed from the drafter's own states and drafts only (never from the
        target), so that truncating on it keeps decoding lossless. Only where `has_confidence`."""
        raise ValueError(f"--confidence-threshold: the {self.architecture} drafter has no confidence head; "
                         "evaluate it without the option")

    def greedy_proposals(self, hidden: torch.Tensor, lm_head: nn.Module, anchor_ids: torch.Tensor,
                         k: int = 0) -> BlockProposals:
        """What replay needs of a chunk of blocks: `draft`'s greedy drafts, with `k > 0` `tree_candidates(k)`, and
        where `has_confidence` `draft_with_confidence`'s predictions. Here the separate calls; a drafter whose
        calls share work (one product with the head) overrides it."""
        if self.has_confidence:
            drafts, _, confidence = self.draft_with_confidence(hidden, lm_head, anchor_ids)
        else:
            drafts, confidence = self.draft(hidden, lm_head, anchor_ids)[0], None
        top_lp, top_ids = self.tree_candidates(hidden, lm_head, anchor_ids, k) if k else (None, None)
        return BlockProposals(drafts, top_lp, top_ids, confidence)

    # ------------------------------------------------------------ a reduced draft vocabulary
    # Only an architecture whose options declare `draft_vocabulary` gets a drafter config with `draft_vocab_size`.

    @property
    def draft_vocab_size(self) -> int:
        """0: the target's vocabulary through the target's lm_head; N: the drafter's own head over N tokens."""
        return 0

    def vocabulary_ids(self) -> torch.Tensor:
        """The target ids of the draft vocabulary, by draft id (`[N]`; needs a reduced vocabulary)."""
        raise ValueError(f"the {self.architecture} drafter has no reduced draft vocabulary")

    def set_draft_vocabulary(self, target_ids: torch.Tensor, target_lm_head: torch.Tensor) -> None:
        """Make the draft vocabulary the target tokens `target_ids` (`[N]`, ascending), its head their rows of the
        target's lm_head weight `[V, H]`."""
        raise ValueError(f"the {self.architecture} drafter has no reduced draft vocabulary")

    # ------------------------------------------------------------ export

    @property
    def export_needs_target_head(self) -> bool:
        """Whether `materialized` needs the target's lm_head weight (else it returns the drafter itself)."""
        return False

    def materialized(self, head_weight: torch.Tensor) -> "Drafter":
        """This drafter in its reference layout, for an export: itself, unless some of its trained weights are a
        training-time parametrisation that needs the target's lm_head weight `[V, H]` to become reference tensors
        (e.g. factored codebooks computed through the target's head)."""
        return self
