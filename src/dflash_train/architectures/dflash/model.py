"""The DFlash drafter (arXiv 2602.06036, z-lab/dflash): the family's block drafter as it is (`family.model`), with a
reduced draft vocabulary where its config has one (its own lm_head over the N most frequent label tokens and the
`d2t` offsets to target ids, vLLM's names)."""

from __future__ import annotations

from ..family.model import BlockDrafter


class DFlashDrafter(BlockDrafter):
    architecture = "dflash"
    reduced_vocabulary = True

    def compiled_name(self) -> str:
        """DFlash's compiled layer parts are named `drafter_*` in the compile layer; a subclass registered under
        another architecture name gets names of its own."""
        return "drafter" if self.architecture == DFlashDrafter.architecture else super().compiled_name()
