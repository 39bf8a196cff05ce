"""DSpark (arXiv 2607.05147): DFlash's backbone with the anchor as the first prediction, a Markov head that corrects
each slot's logits by the token before it, and a confidence head that predicts each slot's acceptance.

- `blocks.py`: DSpark's block layout from the family's (`family.blocks`): slot k of the block at anchor a reads the
  anchor (k = 0) or the mask token and predicts `input_ids[a + k + 1]`; supervision stops at the first slot that
  does not count;
- `model.py`: the drafter (DFlash's layers, the Markov and confidence heads, sequential decoding);
- `loss.py`: CE + L1 against the target's distribution, both in lm_head chunks (full logits never exist);
- `objective.py`: the loss on one micro-batch, with the confidence BCE;
- `config.py`: the drafter config and the exported flat `Qwen3DSparkModel` config.json;
- `options.py`: the run config's `dspark:` section (torch-free: the config loader imports it);
- `architecture.py`: the `Architecture` the registry resolves.
"""


def __getattr__(name: str):
    """`ARCHITECTURE` on first use: importing this package (as the config loader does, for `options.py`) must not
    import torch."""
    if name == "ARCHITECTURE":
        from .architecture import ARCHITECTURE

        return ARCHITECTURE
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
