"""DFlash2: DFlash's one-pass block drafter with two cheap modules, both starting as the identity (so an
untrained DFlash2 drafter computes what a DFlash one does):

- `conv.py`: a grouped dynamic causal convolution before and after each attention and MLP sublayer, inside
  each block only;
- `selector.py`: a candidate selector over each slot's top-k logits, scored with a low-rank bilinear term
  between neighbours; decoding walks it from the anchor;
- `model.py`: the drafter (DFlash's layers with the convolutions; the selector's `draft` and tree candidates);
- `objective.py`: DFlash's slot loss plus the selector's loss over forced top-k candidates;
- `config.py`: the drafter config and the exported `DFlash2DraftModel` config.json.

Everything else (anchors, blocks, the mask, the attention backend, the chunked loss) is DFlash's.
"""

from ..base import Architecture
from ..dflash.attention import resolve_backend
from .config import HF_ARCHITECTURE, config_for_run, dflash2_config_from_dict, dflash2_config_json
from .model import DFlash2Drafter
from .objective import DFlash2Objective

ARCHITECTURE = Architecture(
    name="dflash2",
    hf_architecture=HF_ARCHITECTURE,
    drafter_class=DFlash2Drafter,
    config_for_run=config_for_run,
    config_from_dict=dflash2_config_from_dict,
    config_json=dflash2_config_json,
    resolve_backend=resolve_backend,
    objective=DFlash2Objective,
)
