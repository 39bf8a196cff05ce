"""DFlash2: DFlash's one-pass block drafter with two cheap modules, both starting as the identity (so an
untrained DFlash2 drafter computes what a DFlash one does):

- the family's `conv.py` (shared with other members): a grouped dynamic causal convolution before and
  after each attention and MLP sublayer, inside each block only;
- `selector.py`: a candidate selector over each slot's top-k logits, scored with a low-rank bilinear term
  between neighbours; decoding walks it from the anchor;
- `model.py`: the drafter (DFlash's layers with the convolutions; the selector's `draft` and tree candidates);
- `objective.py`: DFlash's slot loss plus the selector's loss over forced top-k candidates;
- `config.py`: the drafter config and the exported `DFlash2DraftModel` config.json;
- `options.py`: the run config's `dflash2:` section (torch-free: the config loader imports it);
- `architecture.py`: the `Architecture` the registry resolves.

Everything else (anchors, blocks, the mask, the attention backend, the chunked loss) is the family's
(`architectures/family/`).
"""


def __getattr__(name: str):
    """`ARCHITECTURE` on first use: importing this package (as the config loader does, for `options.py`) must not
    import torch."""
    if name == "ARCHITECTURE":
        from .architecture import ARCHITECTURE

        return ARCHITECTURE
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
