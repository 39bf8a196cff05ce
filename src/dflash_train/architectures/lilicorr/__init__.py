"""LiLiCorr (NVIDIA, arXiv 2608.20530): DFlash's backbone with a small reranker over its own per-slot top-k
candidates. The head scores transitions between adjacent slots' candidates (a lattice), and decoding walks the
lattice greedily from the anchor instead of taking each slot's argmax; verification is DFlash's, so it is lossless.

- `head.py`: the `lilicorr` head (candidate features, two bidirectional layers over the lattice, the factor heads);
- `model.py`: the drafter (the family's block drafter, the head, the lattice walk);
- `objective.py`: the DFlash block loss plus the lattice's CE, margin and target-penalty terms;
- `config.py`: the drafter config and the exported `LiLiCorrDraftModel` config.json;
- `memory.py`, `flops.py`: the head's terms in the step's activation estimate and model FLOPs;
- `options.py`: the run config's `lilicorr:` section (torch-free: the config loader imports it);
- `architecture.py`: the `Architecture` the registry resolves.
"""


def __getattr__(name: str):
    """`ARCHITECTURE` on first use: importing this package (as the config loader does, for `options.py`) must not
    import torch."""
    if name == "ARCHITECTURE":
        from .architecture import ARCHITECTURE

        return ARCHITECTURE
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
