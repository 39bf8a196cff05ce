"""DFlash (arXiv 2602.06036): a block-diffusion drafter conditioned on the target's hidden states.

- `blocks.py`: anchors, blocks, same-position labels, counted slots, slot weights.
- `mask.py`: the one mask predicate (dense and flex forms).
- `attention.py`: the attention backend (flex block-sparse on CUDA, dense sdpa elsewhere).
- `model.py`: the drafter (Qwen3-style layers, KV injection of the context).
- `loss.py`: the chunked lm_head + weighted cross-entropy (full logits never exist).
- `objective.py`: the loss on one micro-batch, for the training step, validation and the warm-up.
- `config.py`: the drafter's config from the target's, and the exported config.json.
"""

from ..base import Architecture
from .attention import resolve_backend
from .config import config_for_run, drafter_config_from_dict, drafter_config_json
from .model import DFlashDrafter
from .objective import DFlashObjective

ARCHITECTURE = Architecture(
    name="dflash",
    hf_architecture="DFlashDraftModel",
    drafter_class=DFlashDrafter,
    config_for_run=config_for_run,
    config_from_dict=drafter_config_from_dict,
    config_json=drafter_config_json,
    resolve_backend=resolve_backend,
    objective=DFlashObjective,
)
