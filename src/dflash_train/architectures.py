"""The drafter architectures by name, without importing any of them: the values `drafter.architecture` takes
(config.py checks them) and the `architectures` name of each one's exported config.json. `algorithms` resolves a
name to its package (`algorithms.architecture`)."""

from __future__ import annotations

PACKAGES = {  # drafter.architecture -> (its package under algorithms/, the `architectures` name of its config.json)
    "dflash": ("dflash", "DFlashDraftModel"),
    "dflash2": ("dflash2", "DFlash2DraftModel"),
}
NAMES = tuple(PACKAGES)
