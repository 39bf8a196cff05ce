"""DFlash (arXiv 2602.06036): a block-diffusion drafter conditioned on the target's hidden states; the family's
block drafter and slot-weighted cross-entropy as they are (`architectures/family/`), with a reduced draft vocabulary.

- `model.py`: the drafter (the family's, with its own head over a reduced vocabulary);
- `objective.py`: the slot-weighted CE (with distillation) of a micro-batch;
- `config.py`: the drafter's config from the run's;
- `options.py`: what it declares without torch (the config loader imports it);
- `architecture.py`: the `Architecture` the registry resolves.
"""


def __getattr__(name: str):
    """`ARCHITECTURE` on first use: importing this package (as the config loader does, for `options.py`) must not
    import torch."""
    if name == "ARCHITECTURE":
        from .architecture import ARCHITECTURE

        return ARCHITECTURE
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
