"""Anchors, block inputs, labels and loss weights of one micro-batch (the block objective's data side).

Anchors: positions p with `loss_mask[p] == 1` and `p <= length - block_size`, up to `max_anchors`
per sequence, drawn without replacement, sorted; rows with fewer pad with `keep = False`.
Labels are same-position: slot k of block n predicts `input_ids[a_n + k]`. Slot 0 (the anchor)
never counts; slot k counts iff the block is kept, `a_n + k < length` and `loss_mask[a_n + k]`.
Weights: `exp(-(k - 1) / gamma)` for counted slots, or, computed after the drafter's forward from its own
detached label probabilities, (`acceptance_weights`) its probability of reaching the slot or (`dpace_weights`)
the D-PACE weight, the sum of its smoothed probabilities of getting through each counted slot from this one on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Optional

import numpy as np
import torch

from ...runtime import to_device
from ..stats import DraftWork


@dataclass
class Blocks:
    anchors: torch.Tensor  # [B, N] long
    keep: torch.Tensor  # [B, N] bool
    block_ids: torch.Tensor  # [B, N*bs] long: anchor token, then mask tokens
    block_positions: torch.Tensor  # [B, N*bs] long: a_n + 0..bs-1
    labels: torch.Tensor  # [B, N, bs] long
    weights: torch.Tensor  # [B, N, bs] float32 gamma weights, 0 where the slot does not count
    counted: torch.Tensor  # [B, N, bs] bool: the slot is trained
    # The host counts of the drafter's work on these blocks, taken where they are built on the host (the step
    # plans them there); None for blocks built on a device (counting them would wait for it).
    work: Optional[DraftWork] = field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        if self.work is None and self.keep.device.type == "cpu":
            self.work = DraftWork.of(self.anchors, self.keep, self.counted.shape[-1], int(self.counted.sum()))

    @property
    def num_blocks(self) -> int:
        return self.anchors.shape[1]

    def moved(self, device: torch.device) -> dict:
        """The fields on `device` (the host counts kept as they are): a subclass's `to` builds itself from them."""
        return {f.name: getattr(self, f.name) if f.name == "work" else to_device(getattr(self, f.name), device)
                for f in fields(self)}

    def to(self, device: torch.device) -> "Blocks":
        return Blocks(**self.moved(device))


def sample_anchors(
    loss_mask: torch.Tensor,
    lengths: torch.Tensor,
    block_size: int,
    max_anchors: int,
    generator: torch.Generator,
    multiple_of: int = 1,
    max_batch_anchors: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns anchors `[B, N]` (sorted per row) and keep `[B, N]`. N is the largest per-row count,
    rounded up to `multiple_of` (extra blocks are not kept). Random keys come from `generator` (CPU)
    so that a step's anchors depend only on the seed and the data. `max_batch_anchors` > 0 bounds
    B * N: a row takes at most `max_batch_anchors // B` anchors, rounded down to `multiple_of` (at
    least `multiple_of`, so B * N <= max(max_batch_anchors, B * multiple_of))."""
    batch, seq = loss_mask.shape
    if batch:
        max_anchors = int(anchors_a_row(batch, max_anchors, max_batch_anchors, multiple_of))
    pos = torch.arange(seq, device=loss_mask.device)
    valid = (loss_mask > 0) & (pos.view(1, -1) <= (lengths.view(-1, 1) - block_size))
    keys = torch.rand(batch, seq, generator=generator).to(loss_mask.device)
    keys = torch.where(valid, keys, torch.full_like(keys, 2.0))  # invalid positions sort last
    counts = valid.sum(1).clamp(max=max_anchors)
    n = max(int(counts.max().item()) if batch else 0, 1)
    n = math.ceil(n / multiple_of) * multiple_of
    n_take = min(n, seq)
    chosen = torch.topk(keys, n_take, dim=1, largest=False).indices  # random subset of valid positions
    keep = torch.arange(n_take, device=loss_mask.device).view(1, -1) < counts.view(-1, 1)
    # Sort the kept anchors; not-kept slots get a sentinel so they sort last, then read 0.
    sortable = torch.where(keep, chosen, torch.full_like(chosen, seq))
    anchors = torch.sort(sortable, dim=1).values
    anchors = torch.where(keep, anchors, torch.zeros_like(anchors))
    if n_take < n:  # (only when seq < multiple_of * something) pad with not-kept blocks
        pad = n - n_take
        anchors = torch.cat([anchors, anchors.new_zeros(batch, pad)], 1)
        keep = torch.cat([keep, keep.new_zeros(batch, pad)], 1)
    return anchors, keep


def anchors_a_row(rows, max_anchors: int, max_batch_anchors: int, multiple_of: int):
    """The most anchors a row of a `rows`-row micro-batch takes (an int or an array of row counts):
    `max_anchors`, and with `max_batch_anchors` > 0 its share of them, rounded down to `multiple_of` (at least
    `multiple_of`)."""
    cap = np.full(np.shape(rows), max_anchors, dtype=np.int64)
    if max_batch_anchors > 0:
        share = max_batch_anchors // np.asarray(rows) // multiple_of * multiple_of
        cap = np.minimum(cap, np.maximum(share, multiple_of))
    return cap


def blocks_for(rows: np.ndarray, anchor_positions: np.ndarray, max_anchors: int, max_batch_anchors: int,
               multiple_of: int) -> np.ndarray:
    """Per batch (`rows` rows, at most `anchor_positions` positions a row that can anchor a block): the
    blocks `sample_anchors` gives it, as it caps and rounds them."""
    cap = anchors_a_row(rows, max_anchors, max_batch_anchors, multiple_of)
    n = np.maximum(np.minimum(anchor_positions, cap), 1)
    return -(-n // multiple_of) * multiple_of


def most_blocks(max_batch_size: int, token_budget: int, max_length: int, block_size: int, blocks_a_row: int,
                max_batch_anchors: int, multiple_of: int) -> int:
    """The most blocks one micro-batch can hold (`blocks_for` over its row counts up to `max_batch_size`, each row
    as long as `max_length` and `token_budget` let it be): the largest micro-batch the step's memory estimate
    counts (train/plan/activation_memory.py `largest_micro_batches`)."""
    rows = np.arange(1, max_batch_size + 1)
    context = np.minimum(max_length, token_budget // rows)
    fits = context >= block_size
    if not fits.any():
        return 1
    blocks = blocks_for(rows[fits], context[fits] - block_size + 1, blocks_a_row, max_batch_anchors, multiple_of)
    return int((rows[fits] * blocks).max())


def gamma_weights(block_size: int, gamma: float, device=None) -> torch.Tensor:
    """`w_k = exp(-(k - 1) / gamma)` for k >= 1, and 0 for the anchor slot."""
    k = torch.arange(block_size, device=device, dtype=torch.float32)
    w = torch.exp(-(k - 1) / gamma)
    w[0] = 0.0
    return w


def build_blocks(
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    lengths: torch.Tensor,
    anchors: torch.Tensor,
    keep: torch.Tensor,
    block_size: int,
    mask_token_id: int,
    gamma: float,
) -> Blocks:
    batch, seq = input_ids.shape
    n = anchors.shape[1]
    offsets = torch.arange(block_size, device=input_ids.device)
    positions = anchors.unsqueeze(-1) + offsets  # [B, N, bs]
    in_range = positions < lengths.view(-1, 1, 1)
    gather_at = positions.clamp(max=seq - 1).view(batch, -1)
    labels = torch.gather(input_ids, 1, gather_at).view(batch, n, block_size)
    supervised = torch.gather(loss_mask, 1, gather_at).view(batch, n, block_size) > 0
    counted = keep.unsqueeze(-1) & in_range & supervised
    counted[..., 0] = False
    weights = gamma_weights(block_size, gamma, input_ids.device).view(1, 1, -1) * counted
    block_ids = torch.full_like(labels, mask_token_id)
    block_ids[..., 0] = labels[..., 0]
    return Blocks(
        anchors=anchors,
        keep=keep,
        block_ids=block_ids.view(batch, -1),
        block_positions=positions.view(batch, -1),
        labels=labels,
        weights=weights,
        counted=counted,
    )


def acceptance_weights(label_logp: torch.Tensor, counted: torch.Tensor, floor: float) -> torch.Tensor:
    """Position weights by expected acceptance: counted slot k weighs `max(prod_{j<k} p_j, floor)`, where
    `p_j = exp(label_logp[..., j])` is the drafter's probability of slot j's label and the product runs over
    the block's counted slots only (uncounted slots, slot 0 here, the given anchor, among them, are factor 1; in
    a shifted layout, where slot 0 is the first draft and counts, it weighs 1). `label_logp`
    and `counted` are `[B, N, bs]`; the result is detached, 0 where the slot does not count."""
    logp = label_logp.detach().to(torch.promote_types(label_logp.dtype, torch.float32))
    logp = torch.where(counted, logp, torch.zeros_like(logp))
    before = torch.nn.functional.pad(logp[..., :-1], (1, 0))  # slot k sees slots < k
    reach = torch.exp(torch.cumsum(before, -1))
    return reach.clamp_min(floor) * counted


def dpace_weights(label_logp: torch.Tensor, counted: torch.Tensor, alpha: float) -> torch.Tensor:
    """D-PACE position weights (arXiv 2605.18810): counted slot j weighs `w_j = sum_{counted m >= j} P_m`,
    `P_m = prod_{counted i <= m} f_i`, `f_i = (1 - alpha) * q_i + alpha`, with `q_i = exp(label_logp[..., i])`
    the drafter's probability of slot i's label (the hard label, also when distilling). `label_logp` and
    `counted` are `[B, N, bs]`; the result is detached, 0 where the slot does not count.

    Uncounted slots (slot 0, the given anchor; slots past the sequence end; slots outside the loss mask;
    every slot of a block that is not kept) are dropped from the block: each is a factor 1 in the products
    and no term of the sums, and its `label_logp` does not matter. So a block's weights are the formula applied
    to its counted slots alone, in order, and no slot that cannot be trained adds to them: a block with no
    counted slot weighs 0 throughout, and one whose only counted slots are j < m has `w_j = f_j + f_j f_m`,
    `w_m = f_j f_m` whatever lies between or after. `w_j` is the derivative of the block's smoothed expected
    accepted length `sum_{counted m} P_m` with respect to `log f_j`. With alpha = 1 every factor is 1 and
    `w_j` is the number of counted slots at or after j."""
    logp = label_logp.detach().to(torch.promote_types(label_logp.dtype, torch.float32))
    factor = (1.0 - alpha) * torch.exp(logp) + alpha
    factor = torch.where(counted, factor, torch.ones_like(factor))
    reach = torch.cumprod(factor, -1) * counted  # P_m over counted m, 0 elsewhere
    # Suffix sums by flipping (not total - prefix): late slots' small weights keep their relative precision.
    return reach.flip(-1).cumsum(-1).flip(-1) * counted
