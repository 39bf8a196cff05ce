"""DSpark's blocks, read off the family's (`family.blocks.build_blocks`) one slot longer: DFlash's block of B + 1 at
anchor a labels `input_ids[a + 0..B]`; DSpark's block of B at a reads its first B inputs (the anchor, then mask
tokens) at positions `a + 0..B-1`, and slot k predicts DFlash's slot k + 1, `input_ids[a + k + 1]`. The token before
slot k's label (the Markov head's input, teacher-forced) is DFlash's label k: the anchor for k = 0. A slot counts
while every slot before it in its block does (the reference's cumulative mask). Anchors: positions p with
`loss_mask[p]` and `loss_mask[p + 1]` (p + 1 < length). The mask is DFlash's predicate over blocks of B.
"""

from __future__ import annotations

import torch

from ..family.blocks import Blocks, build_blocks, sample_anchors


def anchor_mask(loss_mask: torch.Tensor) -> torch.Tensor:
    """Where an anchor may sit: the position and the next one are both supervised."""
    nxt = torch.nn.functional.pad(loss_mask[:, 1:], (0, 1))
    return loss_mask * nxt


def slot_weights(block_size: int, gamma: float, device=None) -> torch.Tensor:
    """`w_k = exp(-k / gamma)`, k = 0..B-1 (slot 0, the anchor's own prediction, counts)."""
    return torch.exp(-torch.arange(block_size, device=device, dtype=torch.float32) / gamma)


def dspark_blocks(input_ids, loss_mask, lengths, anchors, keep, block_size: int, mask_token_id: int,
                  gamma: float) -> tuple[Blocks, torch.Tensor]:
    """(the blocks, the previous token of each slot `[B, N, bs]`)."""
    longer = build_blocks(input_ids, loss_mask, lengths, anchors, keep, block_size + 1, mask_token_id, 1.0)
    b, n = anchors.shape
    counted = longer.counted[..., 1:].long().cumprod(-1).bool()
    weights = slot_weights(block_size, gamma, input_ids.device).view(1, 1, -1) * counted
    blocks = Blocks(
        anchors=anchors, keep=keep,
        block_ids=longer.block_ids.view(b, n, -1)[..., :block_size].reshape(b, -1),
        block_positions=longer.block_positions.view(b, n, -1)[..., :block_size].reshape(b, -1),
        labels=longer.labels[..., 1:].contiguous(), weights=weights, counted=counted)
    return blocks, longer.labels[..., :-1].contiguous()


def plan(input_ids, loss_mask, lengths, block_size: int, max_anchors: int, generator: torch.Generator,
         mask_token_id: int, gamma: float, multiple_of: int = 1, max_batch_anchors: int = 0):
    """Anchors drawn as DFlash draws them (at most `max_anchors` a row, sorted), over `anchor_mask`."""
    anchors, keep = sample_anchors(anchor_mask(loss_mask), lengths, 2, max_anchors, generator, multiple_of,
                                   max_batch_anchors)
    return dspark_blocks(input_ids, loss_mask, lengths, anchors, keep, block_size, mask_token_id, gamma)
