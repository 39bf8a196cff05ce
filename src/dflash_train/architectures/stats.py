"""What a training step reports: the host counts of a micro-batch's drafter work (the FLOP accounting's) and the
step's sums (loss, per-slot hits, the acceptance estimate), added up over micro-batches."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch


@dataclass(frozen=True)
class DraftWork:
    """The sizes of a micro-batch's drafter work, counted on the host where its blocks were planned (no device
    read): the drafter's side of the FLOP accounting (train/loop/flops.py). Counts add up over micro-batches."""

    blocks: int = 0  # kept blocks (the drafted blocks)
    block_tokens: int = 0  # their query positions: blocks x block size
    attended: int = 0  # (query, key) pairs of their attention: each query sees the context before its anchor and
    # its own block (full attention; a sliding-window or in-block causal layer sees fewer)
    counted_rows: int = 0  # rows through the vocabulary head and the loss
    # target positions whose logits the loss forms, each once (a loss term against the target's distribution that
    # reads each position's logits once, however many rows share it; 0 where the loss forms none)
    target_positions: int = 0

    @staticmethod
    def of(anchors: torch.Tensor, keep: torch.Tensor, block_size: int, counted_rows: int) -> "DraftWork":
        """From host `anchors` / `keep` `[B, N]` (not-kept blocks count nothing)."""
        kept = int(keep.sum())
        before_anchor = int((anchors * keep).sum())
        return DraftWork(kept, kept * block_size, (before_anchor + kept * block_size) * block_size, int(counted_rows))

    def __add__(self, other: "DraftWork") -> "DraftWork":
        return DraftWork(self.blocks + other.blocks, self.block_tokens + other.block_tokens,
                         self.attended + other.attended, self.counted_rows + other.counted_rows,
                         self.target_positions + other.target_positions)


@dataclass
class StepStats:
    """Sums over a micro-batch or a step (tensors on the device: read them only when logging)."""

    loss: torch.Tensor
    correct_per_slot: torch.Tensor  # [bs] counted slots predicted right
    counted_per_slot: torch.Tensor  # [bs] counted slots
    accepted_sum: torch.Tensor  # sum over kept blocks of the acceptance-length estimate
    kept_blocks: torch.Tensor
    grad_norm: torch.Tensor | None = None
    # An architecture's own metrics: `*_loss` values (averaged over micro-batches, logged as they are) and
    # counts of counted slots (summed, logged as a share of the counted slots), e.g. an extra module's own loss.
    extra: dict[str, torch.Tensor] = field(default_factory=dict)
    # Host counts of the drafter's work (`DraftWork`); None where the blocks were planned on the device.
    work: Optional[DraftWork] = None
    # Where the loss is a mean over the whole step's terms (every micro-batch's and every rank's, as the on-policy
    # stage's official estimator normalises): the weight of this micro-batch's mean `loss` in it, its terms'
    # denominator (no gradient). The step then trains on `sum(loss * normaliser) / sum(normaliser)` over its
    # micro-batches and ranks instead of the mean of the micro-batches' losses. None: a mean of micro-batch means.
    normaliser: Optional[torch.Tensor] = None

    @staticmethod
    def sum(parts: "list[StepStats]") -> "StepStats":
        """Counts add up over micro-batches; the losses are their mean, weighted by their normalisers if they have
        them."""
        extra = {k: (torch.stack([p.extra[k] for p in parts]).mean() if k.endswith("_loss")
                     else sum(p.extra[k] for p in parts)) for k in parts[0].extra}
        works = [p.work for p in parts]
        weighted = [p.normaliser for p in parts if p.normaliser is not None]
        if weighted and len(weighted) != len(parts):
            raise ValueError("either every micro-batch's loss has a normaliser or none has")
        if weighted:
            normaliser = torch.stack(weighted).sum()
            loss = torch.stack([p.loss * p.normaliser for p in parts]).sum() / normaliser.clamp_min(1e-6)
        else:
            normaliser, loss = None, torch.stack([p.loss for p in parts]).mean()
        return StepStats(
            loss=loss,
            correct_per_slot=sum(p.correct_per_slot for p in parts),
            counted_per_slot=sum(p.counted_per_slot for p in parts),
            accepted_sum=sum(p.accepted_sum for p in parts),
            kept_blocks=sum(p.kept_blocks for p in parts),
            extra=extra,
            work=None if None in works else sum(works[1:], works[0]),
            normaliser=normaliser,
        )


def acceptance_estimate(correct: torch.Tensor) -> torch.Tensor:
    """`[..., bs]` correctness of slots 1..bs-1 (slot 0 ignored) -> `1 + leading run of correct slots`."""
    return 1 + correct[..., 1:].long().cumprod(-1).sum(-1)
