"""Domino: DFlash's one-pass block drafter in the `shift_label` layout (slot n predicts the token after
`anchor + n`), with a sequential correction: a bias-free GRU over the target's embeddings of the block's previous
tokens and a low-rank projector that adds a full-vocabulary logit delta from `[slot hidden ; GRU state]` to every
slot from `pure_draft_prefix_len` on.

- `model.py`: the drafter (DFlash's layers; the GRU and projector; the sequential `draft`);
- `objective.py`: final and base cross-entropy with the linearly decaying base weight;
- `config.py`: the drafter config and its config.json;
- `options.py`: the run config's `domino:` section (torch-free: the config loader imports it);
- `memory.py`: its terms in the step's activation estimate;
- `architecture.py`: the `Architecture` the registry resolves.
"""


def __getattr__(name: str):
    """`ARCHITECTURE` on first use: importing this package (as the config loader does, for `options.py`) must not
    import torch."""
    if name == "ARCHITECTURE":
        from .architecture import ARCHITECTURE

        return ARCHITECTURE
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
