"""The LiLiCorr objective on one micro-batch (the shipped recipe's, trained jointly with the backbone):

  loss = L_dflash + w_ce L_ce + w_margin L_margin + w_pen L_pen

- L_dflash: the family's block cross-entropy, `sum w CE / (sum w + 1e-6)` (0 where `sum w <= 1`), w the slot weights
  (`objective.slot_weighting`, the recipe's gamma decay by default);
- the lattice terms, over the blocks whose every drafted slot counts: each slot's candidates are the detached top-k
  of its logits, their log-probabilities (normalised over the full vocabulary, with gradient: the lattice reaches
  the backbone through them) feed the head (`head.py`), and the chain is teacher-forced, slot s's log-potentials
  `node_s` the row leaving the gold predecessor (`log_start` for slot 0). Slot s is supervised while the gold was
  among the candidates of every slot up to s (`sup_s`, a cumulative product; no gold is inserted), and with
  `D = max(1, sum sup)`:
    L_ce = sum sup CE(node_s, gold) / D,   L_margin = sum sup relu(margin - gap_s) / D,
    L_pen = sum_s sup_s sum_j softmax(node_s)_j relu(zT[gold] - zT[c_j]) / D,
  gap_s the gold's log-potential minus the best other's, zT the target's logits (detached) at the candidates from
  the position that predicted the slot's label.

Metrics (sums of slots, logged as shares of the counted slots): the greedy walk's correct prefix (what decoding
drafts), the backbone argmax's, and the oracle's (the gold among the candidates).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from functools import cached_property
from typing import Callable, Optional

import torch
from torch.nn import functional as F

from ...data.batch import Batch
from ..family.blocks import Blocks, most_blocks
from ..family.loss import candidate_logits
from ..family.objective import BlockObjective, block_stats, row_weights, slot_weighting_text
from ..stats import StepStats
from .head import chunk_blocks, greedy_walk
from .options import loss_weights, options_of


@dataclass
class Lattice:
    """The lattice terms' inputs for the `n` blocks whose every drafted slot counts (S slots of k candidates)."""

    log_start: torch.Tensor  # [n, k] float32
    log_pair: torch.Tensor  # [n, S-1, k, k] float32
    gold_in: torch.Tensor  # [n, S] bool: the gold among the slot's candidates
    gold_rank: torch.Tensor  # [n, S] long: its rank (0 where absent)
    target_logits: torch.Tensor  # [n, S, k] float32 the target's logits at the candidates (detached)


@dataclass
class LatticeBlocks(Blocks):
    """The family's blocks, with the lattice's rows planned beside them on the host (reading them on the device
    would wait for it): the blocks whose every drafted slot counts and, for each, its slots' places among the
    counted rows (`idx`'s order)."""

    whole: torch.Tensor  # [n] long: flat block index over [B, N]
    slot_rows: torch.Tensor  # [n, S] long

    def to(self, device: torch.device) -> "LatticeBlocks":
        return LatticeBlocks(**self.moved(device))


def lattice_blocks(blocks: Blocks) -> LatticeBlocks:
    """`blocks` with the lattice's rows: `whole` and `slot_rows`, a counted row's place being the number of counted
    slots before it in flat [B, N, bs] order (how `plan_blocks` lays out `idx`)."""
    b, n, bs = blocks.counted.shape
    counted = blocks.counted.view(-1)
    whole = blocks.counted[..., 1:].all(-1).view(-1).nonzero().squeeze(1)
    place = counted.long().cumsum(0) - 1
    slot_rows = place.view(b * n, bs).index_select(0, whole)[:, 1:]
    return LatticeBlocks(**{f.name: getattr(blocks, f.name) for f in fields(blocks)}, whole=whole, slot_rows=slot_rows)


def lattice_terms(lat: Lattice, margin: float, with_margin: bool) -> dict[str, torch.Tensor]:
    """L_ce, L_margin (0 unless `with_margin` and k > 1), L_pen and the prefix metrics of `lat`."""
    k = lat.log_start.shape[-1]
    given_gold = lat.log_pair.gather(2, lat.gold_rank[:, :-1, None, None].expand(-1, -1, 1, k)).squeeze(2)
    nodes = torch.cat([lat.log_start.unsqueeze(1), given_gold], 1)  # [n, S, k]
    logq = torch.log_softmax(nodes, -1)
    gold = lat.gold_rank.unsqueeze(-1)
    sup = lat.gold_in.long().cumprod(-1).to(nodes.dtype)
    denominator = sup.sum().clamp_min(1.0)
    out = {"ce": (-logq.gather(-1, gold).squeeze(-1) * sup).sum() / denominator}
    if with_margin and k > 1:
        others = nodes.masked_fill(F.one_hot(lat.gold_rank, k).bool(), float("-inf")).amax(-1)
        gap = nodes.gather(-1, gold).squeeze(-1) - others
        out["margin"] = (F.relu(margin - gap) * sup).sum() / denominator
    else:
        out["margin"] = nodes.new_zeros(())
    penalty = F.relu(lat.target_logits.gather(-1, gold) - lat.target_logits)
    out["pen"] = (sup * (logq.exp() * penalty).sum(-1)).sum() / denominator
    with torch.no_grad():
        walk = greedy_walk(lat.log_start, lat.log_pair)
        out["selected_prefix"] = ((walk == lat.gold_rank) & lat.gold_in).long().cumprod(-1).sum()
        out["top1_prefix"] = ((lat.gold_rank == 0) & lat.gold_in).long().cumprod(-1).sum()
        out["oracle_prefix"] = sup.detach().sum().long()
    return out


def lattice_chunk(objective, blocks_a_row: int) -> int:
    """Blocks one chunk of the head holds in every training step of `objective`'s run (`head.chunk_blocks` of its
    largest micro-batch, `family.blocks.most_blocks`, at most `blocks_a_row` blocks a row)."""
    cfg, d = objective.cfg, objective.drafter
    most = most_blocks(cfg.data.max_batch_size, cfg.data.token_budget, cfg.data.max_length, d.block_size, blocks_a_row,
                       cfg.objective.max_anchors_per_batch, objective.backend.blocks_multiple_of)
    return chunk_blocks(most, d.block_size - 1, d.topk)


class LiLiCorrObjective(BlockObjective):
    @cached_property
    def lattice_chunk(self) -> int:
        return lattice_chunk(self, self.cfg.objective.max_anchors)

    def build_blocks(self, plan: Batch, anchors: torch.Tensor, keep: torch.Tensor) -> LatticeBlocks:
        return lattice_blocks(super().build_blocks(plan, anchors, keep))

    def describe(self) -> str:
        w_ce, w_margin, w_pen, margin = loss_weights(options_of(self.cfg))
        terms = f"{w_ce:g} x lattice CE + {w_pen:g} x target penalty"
        if w_margin:
            terms += f" + {w_margin:g} x margin (margin {margin:g})"
        return (f"block cross-entropy on the data's next tokens ({slot_weighting_text(self.cfg)}) + {terms} over "
                f"each slot's {self.drafter.topk} candidates, the chain teacher-forced")

    def __call__(self, batch: Batch, generator: torch.Generator, call: Optional[Callable] = None,
                 hidden: Optional[torch.Tensor] = None) -> StepStats:
        if hidden is not None:
            raise ValueError("LiLiCorr's target penalty needs the target's final hidden states, which a capture "
                             "computed on another rank (parallel.placement=split) does not carry")
        hidden, final = self.target.capture(batch.input_ids, with_final=True)
        blocks, idx = self.plan_blocks(batch, generator)
        every = torch.arange(blocks.counted.numel(), device=batch.input_ids.device)
        out = self.block_rows(batch, hidden, blocks, every, call or self.drafter)  # [B*N*bs, H], slot 0: anchor rows
        with self.autocast(batch.input_ids.device):
            return self.lilicorr_loss(out, blocks, idx, final)

    def lilicorr_loss(self, out: torch.Tensor, blocks: Blocks, idx: torch.Tensor, final: torch.Tensor) -> StepStats:
        d = self.drafter
        w_ce, w_margin, w_pen, margin = loss_weights(options_of(self.cfg))
        rows = out.index_select(0, idx)
        res, labels, _ = self.unary_rows(rows, blocks, idx, None, top_k=d.topk)
        weights = row_weights(self.cfg, blocks, idx)
        w = (weights(res.label_logp) if callable(weights) else weights).detach().to(res.loss.dtype)
        total = w.sum()
        l_dflash = torch.where(total > 1, (w * res.loss).sum() / (total + 1e-6), torch.zeros_like(total))
        lattice, block_out = self.lattice_inputs(out, rows, res, labels, blocks, idx, final,
                                                 options_of(self.cfg).backbone_gradient)
        log_start, log_pair = d.lattice(block_out, lattice.pop("lp"), lattice["cand"], self.target.embed_tokens,
                                        self.lattice_chunk)
        terms = lattice_terms(Lattice(log_start, log_pair, lattice["gold_in"], lattice["gold_rank"],
                                      lattice["target_logits"]), margin, w_margin > 0)
        loss = l_dflash + w_ce * terms["ce"] + w_margin * terms["margin"] + w_pen * terms["pen"]
        stats = block_stats(loss, res.correct, blocks, idx)
        stats.extra.update({"dflash_loss": l_dflash.detach(), "lattice_ce_loss": terms["ce"].detach(),
                            "lattice_margin_loss": terms["margin"].detach(), "lattice_pen_loss": terms["pen"].detach(),
                            "selected_prefix": terms["selected_prefix"], "top1_prefix": terms["top1_prefix"],
                            "oracle_prefix": terms["oracle_prefix"]})
        return stats

    def lattice_inputs(self, out: torch.Tensor, rows: torch.Tensor, res, labels: torch.Tensor,
                       blocks: LatticeBlocks, idx: torch.Tensor, final: torch.Tensor, backbone_gradient: bool = True
                       ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """The candidates, their log-probabilities and target logits, the gold's place among them, for the blocks
        whose every drafted slot counts (planned on the host: `LatticeBlocks`); and those blocks' forward output
        `[n, bs, H]`. The log-probabilities and the output carry the backbone's gradient where `backbone_gradient`
        (`lilicorr.backbone_gradient`), else they are detached."""
        b, n, bs = blocks.counted.shape
        whole, slot_rows = blocks.whole, blocks.slot_rows  # [n] blocks, flat over [B, N]; [n, S] counted rows
        cand = res.top_ids[slot_rows]
        gold = labels[slot_rows]
        hit = cand == gold.unsqueeze(-1)
        head = self.target.lm_head.weight
        chunk = self.cfg.objective.loss_chunk_size
        h = rows[slot_rows]
        # the values are the chunked CE's own (its logits, its log-sum-exp = CE + the label's logit); the gradient
        # is the same expression's: d lse / dh = d CE / dh + W[label], d z_c / dh = W[c] (`candidate_logits` with
        # the values given: the head's rows are gathered in the backward only, a chunk of rows at a time)
        lse = res.loss[slot_rows] + res.label_logits[slot_rows]
        if backbone_gradient:
            flat, width = h.reshape(-1, h.shape[-1]), cand.shape[-1]
            both = torch.cat([res.top_values[slot_rows], res.label_logits[slot_rows].unsqueeze(-1)], -1)
            z = candidate_logits(flat, head, torch.cat([cand, gold.unsqueeze(-1)], -1).view(-1, width + 1), chunk,
                                 values=both.view(-1, width + 1)).view(both.shape)
            z_cand, z_gold = z[..., :width], z[..., width]
            lse = lse + (z_gold - z_gold.detach())
            lp = z_cand - lse.unsqueeze(-1)
        else:
            lp = (res.top_values[slot_rows] - lse.unsqueeze(-1)).detach()
        seq = final.shape[1]
        source = blocks.block_positions - 1 + torch.arange(b, device=idx.device).view(-1, 1) * seq
        source = source.view(b * n, bs).index_select(0, whole)[:, 1:]  # the position that predicted each label
        with torch.no_grad():
            states = final.reshape(b * seq, -1)[source]
            target_logits = candidate_logits(states.reshape(-1, states.shape[-1]).to(h.dtype), head,
                                             cand.reshape(-1, cand.shape[-1]), chunk).view(cand.shape)
        block_out = out.view(b * n, bs, -1).index_select(0, whole)
        if not backbone_gradient:
            block_out = block_out.detach()
        return ({"lp": lp, "cand": cand, "gold_in": hit.any(-1), "gold_rank": hit.long().argmax(-1),
                 "target_logits": target_logits}, block_out)
