"""The Domino drafter: DFlash's layers in the `shift_label` layout (slot n of the block at anchor a predicts the
token at a + n + 1), with a sequential logit correction. `prefix_gru`, a bias-free GRU, reads the target's
embeddings of the block's tokens a, a + 1, ... one by one; from slot `pure_draft_prefix_len` on, slot n's scores
are `lm_head(z_n) + embed_proj([z_n ; g_n])`, `g_n` the GRU's state after the tokens a .. a + n, and `embed_proj`
a bias-free `H + G -> E -> SiLU -> V` bottleneck. Parameter names equal the served format's tensor names
(`prefix_gru.weight_ih_l0`, `embed_proj.0.weight`, ...)."""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn
from transformers import Qwen3Config

from ..family.model import BlockDrafter
from ..family.reference_fields import transform_logits
from .options import TREE_REFUSAL


class DominoDrafter(BlockDrafter):
    architecture = "domino"

    def __init__(self, config: Qwen3Config):
        super().__init__(config)
        d = config.dflash_config
        h = config.hidden_size
        self.gru_hidden_dim = int(d["gru_hidden_dim"])
        self.emb_dim = int(d["emb_dim"])
        self.pure_draft_prefix_len = int(d["pure_draft_prefix_len"])
        self.prefix_gru = nn.GRU(h, self.gru_hidden_dim, num_layers=1, batch_first=True, bias=False)
        self.embed_proj = nn.Sequential(nn.Linear(h + self.gru_hidden_dim, self.emb_dim, bias=False), nn.SiLU(),
                                        nn.Linear(self.emb_dim, config.vocab_size, bias=False))
        self._token_embed: Optional[Callable[[torch.Tensor], torch.Tensor]] = None
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """DFlash's (every Linear N(0, std), the projector's included); the GRU keeps PyTorch's own
        U(-1/sqrt(G), 1/sqrt(G)), as the reference does (HF's initialisation does not cover nn.GRU)."""
        super().reset_parameters()
        if hasattr(self, "prefix_gru"):  # BlockDrafter's constructor calls this before the GRU exists
            self.prefix_gru.reset_parameters()

    def embed_block(self, embed: Callable[[torch.Tensor], torch.Tensor], block_ids: torch.Tensor) -> torch.Tensor:
        """DFlash's block inputs; the target's embedding is kept for `draft`, whose GRU reads the embeddings of the
        tokens it drafts (decoding always embeds the block first). Kept as a plain attribute: assigned normally, an
        `nn.Embedding` would join the drafter's modules, and the target's table its state_dict, checkpoints and
        exports."""
        object.__setattr__(self, "_token_embed", embed)
        return super().embed_block(embed, block_ids)

    def prefix_states(self, token_embeds: torch.Tensor) -> torch.Tensor:
        """`[n, bs, H]` embeddings of each block's tokens a .. a + bs - 1 -> the GRU's states `[n, bs, G]` (state n
        after tokens a .. a + n), from a zero state."""
        w = self.prefix_gru.weight_ih_l0
        return self.prefix_gru(token_embeds.to(w.dtype))[0]

    def step_state(self, token_embed: torch.Tensor, state: Optional[torch.Tensor]) -> torch.Tensor:
        """One GRU step: `[n, H]` embeddings, `[n, G]` state (None: zero) -> the next state `[n, G]`."""
        w_ih, w_hh = self.prefix_gru.weight_ih_l0, self.prefix_gru.weight_hh_l0
        x = token_embed.to(w_ih.dtype)
        if state is None:
            state = x.new_zeros(x.shape[0], self.gru_hidden_dim)
        return torch.gru_cell(x, state, w_ih, w_hh, None, None)

    def correction_features(self, hidden: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        """`silu(embed_proj[0]([z ; g]))`, the bottleneck `[..., E]` whose product with `embed_proj[2]` is the
        logit correction."""
        first = self.embed_proj[0]
        x = torch.cat([hidden, state.to(hidden.dtype)], dim=-1)
        return self.embed_proj[1](first(x.to(first.weight.dtype)))

    def corrected_logits(self, head_scores: torch.Tensor, hidden: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        """Scores (float32) of final hidden states `[..., H]` with the correction from GRU states `[..., G]`: the
        head's output `head_scores` (float32, before the score transform) plus the correction, then the drafter's
        score transform (multiplier, softcap)."""
        delta = self.embed_proj[2](self.correction_features(hidden, state)).float()
        return transform_logits(head_scores + delta, self.output_multiplier, self.final_logit_softcapping)

    def draft(self, hidden: torch.Tensor, lm_head: nn.Module, anchor_ids: torch.Tensor, temperature: float = 0.0,
              generator: Optional[torch.Generator] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The drafts `[n, bs-1]` of the tokens after the anchor, from slots 0 .. bs-2 (the shifted layout: slot n
        predicts a + n + 1), one at a time: the first `pure_draft_prefix_len` from the backbone's scores, each
        later one with the correction from the GRU's state after the anchor and the drafts before it. With
        `temperature > 0` each is sampled and its distribution `q` (given the drafts before it) returned."""
        embed = self._token_embed
        if embed is None:
            raise RuntimeError("DominoDrafter.draft needs the target's embedding: call embed_block first")
        steps = hidden.shape[1] - 1
        z = hidden[:, :steps]
        head_scores = lm_head(z.to(lm_head.weight.dtype)).float()  # [n, steps, V]: the one product with the head
        state = self.step_state(embed(anchor_ids), None)
        tokens, dists = [], []
        for i in range(steps):
            if i < self.pure_draft_prefix_len:
                logits = transform_logits(head_scores[:, i], self.output_multiplier, self.final_logit_softcapping)
            else:
                logits = self.corrected_logits(head_scores[:, i], z[:, i], state)
            if temperature <= 0:
                token = logits.argmax(-1)
            else:
                q = torch.softmax(logits / temperature, -1)
                token = torch.multinomial(q, 1, generator=generator).squeeze(-1)
                dists.append(q)
            tokens.append(token)
            if i + 1 < steps:
                state = self.step_state(embed(token), state)
        drafts = torch.stack(tokens, 1)
        return drafts, (torch.stack(dists, 1) if dists else None)

    def tree_candidates(self, hidden: torch.Tensor, lm_head: nn.Module, anchor_ids: torch.Tensor,
                        k: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.check_tree_decoding()
        raise AssertionError("unreachable: check_tree_decoding refuses")

    def check_tree_decoding(self) -> None:
        raise ValueError(TREE_REFUSAL)
