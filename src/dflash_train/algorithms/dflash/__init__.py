"""DFlash (arXiv 2602.06036): a block-diffusion drafter conditioned on the target's hidden states.

- `blocks.py`: anchors, blocks, same-position labels, counted slots, slot weights.
- `mask.py`: the one mask predicate (dense and flex forms).
- `attention.py`: the attention backend (flex block-sparse on CUDA, dense sdpa elsewhere).
- `model.py`: the drafter (Qwen3-style layers, KV injection of the context).
- `loss.py`: the chunked lm_head + weighted cross-entropy (full logits never exist).
- `objective.py`: the loss on one micro-batch, for the training step, validation and the warm-up.
- `config.py`: the drafter's config from the target's, and the exported config.json;
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
