"""Token rows -> padded tensors: `collate` right-pads training examples into a `Batch`; `left_pad`
right-aligns prompts for batched generation, so every row's newest token is in the last column."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..runtime import to_device
from .chat import Tokenized


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B, S] right-padded
    loss_mask: torch.Tensor  # [B, S]
    lengths: torch.Tensor  # [B]
    # The CPU batch this one was copied from: the step plans anchors and blocks there (data-dependent
    # sizes read on the host, never from the device).
    host: "Batch | None" = None

    def to(self, device: torch.device) -> "Batch":
        host = self if self.input_ids.device.type == "cpu" and device.type != "cpu" else self.host
        return Batch(*(to_device(t, device) for t in (self.input_ids, self.loss_mask, self.lengths)), host=host)


def collate(examples: list[Tokenized], pad_id: int) -> Batch:
    longest = max(len(e.input_ids) for e in examples)
    ids = torch.full((len(examples), longest), pad_id, dtype=torch.long)
    mask = torch.zeros((len(examples), longest), dtype=torch.long)
    for i, e in enumerate(examples):
        ids[i, : len(e.input_ids)] = torch.from_numpy(e.input_ids.astype(np.int64))
        mask[i, : len(e.loss_mask)] = torch.from_numpy(e.loss_mask.astype(np.int64))
    lengths = torch.tensor([len(e.input_ids) for e in examples], dtype=torch.long)
    return Batch(ids, mask, lengths)


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) [B, longest], each prompt at the right end of its row."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[i, width - len(p):] = 1
    return ids, mask
