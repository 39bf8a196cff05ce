"""The LiLiCorr drafter: the family's block drafter (`BlockDrafter`) with the `lilicorr` head (`head.py`), and with
`lilicorr.conv` the family's convolution-wrapped layers (`family.conv.ConvDecoderLayer`). Slot 0
reads the anchor and drafts nothing; slots 1..B-1 each take their k best tokens under the target's head as
candidates, the head scores the lattice of transitions between them, and the drafts are the greedy walk through it
(`head.greedy_walk`), or with a temperature a walk that samples each step from `softmax(row / T)` over the k
candidates (that distribution, scattered over the vocabulary, is what speculative sampling verifies against).

What the head reads besides the block's hidden states, and how every path gets it:
- the anchor row, `hidden_norm(fc(target features of the position before the anchor))`, the last context row the
  target committed before the block: `forward` returns it in place of slot 0's hidden state (which drafts
  nothing), computed by the same `fc` and `hidden_norm` as the context keys, for every block whose row is among
  the features it was given (training, replay: all of them; decoding with a KV cache: the newest row, the one
  just before the anchor). A block without one gets a zero row, which the head reads as absent;
- the candidates' embeddings, from the target's input embedding: training's objective passes it, and decoding and
  replay form each block's inputs through `embed_block` with it before drafting, which keeps a reference to it.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers import Qwen3Config

from ..attention import DrafterKVCache
from ..drafter import BlockProposals
from ..family.conv import ConvDecoderLayer, has_conv_layers, reset_convs
from ..family.layers import BlockDecoderLayer
from ..family.model import BlockDrafter
from .config import head_fields
from .head import CHUNK_NODES, LiLiCorrHead, greedy_walk
from .options import TREE_REFUSAL


class LiLiCorrDrafter(BlockDrafter):
    architecture = "lilicorr"

    @property
    def layer_class(self) -> type:
        """The family's layers, or with `lilicorr.conv` (its config's conv fields) the convolution-wrapped ones."""
        return ConvDecoderLayer if has_conv_layers(self.config.dflash_config) else BlockDecoderLayer

    def compiled_name(self) -> str:
        return "lilicorr_conv_drafter" if self.layer_class is ConvDecoderLayer else "lilicorr_drafter"

    def compile_layers(self, backend: Optional[str] = None) -> None:
        """The family's compiled layers, and the head's vectors (`LiLiCorrHead.vectors`: its projections, lattice
        layers and factor heads) as one graph for the training step's chunks, which `lattice` pads to one static
        shape (eager, the head ran at about a quarter of the layers' rate: docs/results/performance.md)."""
        from ...accel.compile import compiled
        from ..family import model as family_model

        super().compile_layers(backend)
        backend = backend or family_model.COMPILE_BACKEND
        self._compiled_vectors = compiled(f"{self.compiled_name()}_head[{backend}]", LiLiCorrHead.vectors,
                                          dynamic=False, backend=backend)

    def __init__(self, config: Qwen3Config):
        super().__init__(config)
        f = head_fields(config.dflash_config)
        self.lilicorr = LiLiCorrHead(
            config.hidden_size, self.block_size, f["lilicorr_candidate_topk"], f["lilicorr_hidden_size"],
            f["lilicorr_num_layers"], f["lilicorr_num_heads"], f["lilicorr_mlp_ratio"], f["lilicorr_factor_dim"],
            f["lilicorr_vector_eps"], f["lilicorr_logit_scale"], config.rms_norm_eps)
        self._compiled_vectors: Optional[Callable] = None
        self.reset_parameters()  # again, now that the head exists

    @torch.no_grad()
    def reset_parameters(self) -> None:
        super().reset_parameters()
        reset_convs(self)  # the identity start, after the blanket init of every Linear
        if "lilicorr" in self._modules:
            self.lilicorr.reset_parameters(self.config.initializer_range)

    @property
    def topk(self) -> int:
        return self.lilicorr.topk

    # ------------------------------------------------------------ the forward and what the head reads

    def embed_block(self, embed: Callable[[torch.Tensor], torch.Tensor], block_ids: torch.Tensor) -> torch.Tensor:
        # kept outside the module's registry: the target's table is no parameter of the drafter
        object.__setattr__(self, "_target_embed", embed)
        return super().embed_block(embed, block_ids)

    def forward(self, target_hidden: torch.Tensor, block_embeds: torch.Tensor, position_ids: torch.Tensor,
                attention, mask, cache: Optional[DrafterKVCache] = None, compiled_layers: bool = False) -> torch.Tensor:
        """`BlockDrafter.forward`, slot 0 of every block replaced by its anchor row (zeros where the features
        given do not hold the position before its anchor)."""
        out = super().forward(target_hidden, block_embeds, position_ids, attention, mask, cache, compiled_layers)
        b, q, h = out.shape
        bs, s = self.block_size, target_hidden.shape[1]
        anchors = position_ids[:, s:].reshape(b, -1, bs)[..., 0]  # [b, N]
        if s:
            row = anchors - 1 - position_ids[:, :1]  # its index among the features given
            valid = (row >= 0) & (row < s)
            index = row.clamp(0, s - 1).unsqueeze(-1).expand(-1, -1, target_hidden.shape[-1])
            picked = target_hidden.gather(1, index)
        else:
            valid = torch.zeros_like(anchors, dtype=torch.bool)
            picked = target_hidden.new_zeros(b, anchors.shape[1], target_hidden.shape[-1])
        first = self.hidden_norm(self.fc(picked)).to(out.dtype) * valid.unsqueeze(-1).to(out.dtype)
        return torch.cat([first.unsqueeze(2), out.view(b, -1, bs, h)[:, :, 1:]], 2).view(b, q, h)

    def lattice(self, hidden: torch.Tensor, lp: torch.Tensor, cand: torch.Tensor,
                embed: Callable[[torch.Tensor], torch.Tensor], chunk: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """The head's (log_start, log_pair) for blocks whose `forward` output is `hidden [n, bs, H]`, their slots'
        candidates `cand [n, S, k]` (target ids, best first) and log-probabilities `lp [n, S, k]`. With gradients,
        over chunks of `chunk` blocks (0: `head.CHUNK_NODES` nodes' worth; a run passes one size for all its steps,
        `head.chunk_blocks`), each recomputed in the backward; after `compile_layers`, every chunk padded to that
        many blocks and run through the compiled vectors (one shape: no recompiles)."""
        anchor = hidden[:, 0]
        inputs = (hidden[:, 1:], lp, cand, anchor, anchor.ne(0).any(-1))

        def scores(vectors, blocks, pass_hidden, lp, cand, anchor, present):
            """`blocks` > 0: the inputs padded to that many blocks and contiguous first (one shape and one layout for
            the compiled vectors: a slice's strides differ from a padded copy's); inside the checkpoint, so the
            copies live while one chunk runs and are made again in the backward."""
            if blocks:
                pass_hidden, lp, cand, anchor, present = (
                    pad_blocks(t, blocks) if t.shape[0] < blocks else t.contiguous()
                    for t in (pass_hidden, lp, cand, anchor, present))
            with torch.no_grad():
                embeds = embed(cand)
            return self.lilicorr.scores(*vectors(self.lilicorr, embeds.to(pass_hidden.dtype), pass_hidden, lp,
                                                 anchor, present))

        n, slots, k = cand.shape
        if not torch.is_grad_enabled():  # decoding, replay, validation: eager, no chunks
            return scores(LiLiCorrHead.vectors, 0, *inputs)
        compiled = self._compiled_vectors
        step = chunk or max(1, CHUNK_NODES // (slots * k))  # whole blocks (the head's attention stays within one)
        # No block (none whose every slot counts): one padded block, sliced off, so that every head parameter
        # still gets its (zero) gradient, which data-parallel ranks reduce together.
        padded_to = step if compiled else (1 if n == 0 else 0)
        parts = []
        for i in range(0, max(n, 1), step):
            chunk = [t[i:i + step] for t in inputs]
            size = chunk[0].shape[0]
            start, pair = checkpoint(scores, compiled or LiLiCorrHead.vectors, padded_to, *chunk, use_reentrant=False)
            parts.append((start[:size], pair[:size]))
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])

    # ------------------------------------------------------------ proposals

    def candidates(self, hidden: torch.Tensor, lm_head: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        """Each drafted slot's k best tokens `[n, S, k]` and their log-probabilities over the full vocabulary."""
        logp = torch.log_softmax(self.logits(hidden[:, 1:], lm_head), -1)
        lp, cand = logp.topk(self.topk, dim=-1)
        return lp, cand

    def _scored_lattice(self, hidden: torch.Tensor, lm_head: nn.Module
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The candidates `[n, S, k]` of blocks `[n, bs, H]` and the head's (log_start, log_pair) over them."""
        lp, cand = self.candidates(hidden, lm_head)
        return (cand, *self.lattice(hidden, lp, cand, self._embed()))

    def _embed(self) -> Callable[[torch.Tensor], torch.Tensor]:
        embed = self.__dict__.get("_target_embed")
        if embed is None:
            raise ValueError("a LiLiCorr drafter drafts after its block inputs were formed through embed_block "
                             "(it reads the candidates' embeddings through the target's table it was given)")
        return embed

    def draft(self, hidden: torch.Tensor, lm_head: nn.Module, anchor_ids: torch.Tensor, temperature: float = 0.0,
              generator: Optional[torch.Generator] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        cand, log_start, log_pair = self._scored_lattice(hidden, lm_head)
        if temperature <= 0:
            return walked(cand, greedy_walk(log_start, log_pair)), None
        ranks, q = sampled_walk(log_start, log_pair, temperature, generator)
        dense = q.new_zeros(*cand.shape[:2], lm_head.weight.shape[0]).scatter_(-1, cand, q)
        return walked(cand, ranks), dense

    def check_tree_decoding(self) -> None:
        raise ValueError(TREE_REFUSAL)

    def tree_candidates(self, hidden, lm_head, anchor_ids, k: int):
        raise ValueError(TREE_REFUSAL)

    def greedy_proposals(self, hidden: torch.Tensor, lm_head: nn.Module, anchor_ids: torch.Tensor,
                         k: int = 0) -> BlockProposals:
        """The greedy walk's drafts and the backbone's argmax (rank 0 of every slot) beside them."""
        if k:
            self.check_tree_decoding()
        cand, log_start, log_pair = self._scored_lattice(hidden, lm_head)
        return BlockProposals(walked(cand, greedy_walk(log_start, log_pair)), argmax=cand[..., 0])


def walked(cand: torch.Tensor, ranks: torch.Tensor) -> torch.Tensor:
    """The candidates `[n, S, k]` a walk chose, by their ranks `[n, S]`: target ids `[n, S]`."""
    return cand.gather(-1, ranks.unsqueeze(-1)).squeeze(-1)


def sampled_walk(log_start: torch.Tensor, log_pair: torch.Tensor, temperature: float,
                 generator: Optional[torch.Generator]) -> tuple[torch.Tensor, torch.Tensor]:
    """The walk sampling each step from `softmax(row / T)` over the k candidates (T at least 1e-5): (ranks
    `[n, S]`, each step's distribution `[n, S, k]`)."""
    t = max(temperature, 1e-5)
    row, ranks, dists = log_start, [], []
    for s in range(log_pair.shape[1] + 1):
        if s:
            row = log_pair[:, s - 1].gather(1, ranks[-1].view(-1, 1, 1).expand(-1, 1, log_pair.shape[-1])).squeeze(1)
        p = torch.softmax(row / t, -1)
        ranks.append(torch.multinomial(p, 1, generator=generator).squeeze(1))
        dists.append(p)
    return torch.stack(ranks, 1), torch.stack(dists, 1)


def pad_blocks(t: torch.Tensor, blocks: int) -> torch.Tensor:
    """`t` with zero blocks appended along dim 0 up to `blocks` (a padded block: no anchor, token 0, zero inputs;
    its scores are sliced off, so it adds no gradient)."""
    return torch.cat([t, t.new_zeros(blocks - t.shape[0], *t.shape[1:])])
