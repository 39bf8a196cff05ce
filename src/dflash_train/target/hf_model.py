"""Finding the parts of a Hugging Face causal LM the same way everywhere: the class that loads it (a multimodal
checkpoint: its text model), the module that holds its decoder layers, and the safetensors file of each of its
tensors. Shared by the whole target (capture.py), the sharded ones (shard.py, tensor_parallel.py) and the drafter's
initialisation from the target (architectures/init_from_target.py)."""

from __future__ import annotations

import json
from pathlib import Path

from safetensors import safe_open
from torch import Tensor, nn
from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from ..errors import ModelError
from .hf_config import text_config

# Checkpoint prefixes of multimodal families whose text model we load on its own.
MULTIMODAL_KEY_MAPPING = {
    r"^model\.language_model\.": "model.",
    r"^language_model\.model\.": "model.",
    r"^language_model\.lm_head\.": "lm_head.",
}


def is_multimodal(config: PretrainedConfig) -> bool:
    return text_config(config) is not config


def model_class(config: PretrainedConfig) -> tuple[type, PretrainedConfig]:
    """The class that loads this target, and the config to build it from: a multimodal checkpoint
    loads its text model class when transformers has one, else the whole model (vision unused)."""
    if not is_multimodal(config):
        return AutoModelForCausalLM, config
    tc = text_config(config)
    text_cls = AutoModelForCausalLM._model_mapping.get(type(tc), None)
    if text_cls is not None:
        return text_cls, tc
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText, config


def decoder_of(model: PreTrainedModel) -> nn.Module:
    """The module that owns the decoder layer list (e.g. LlamaModel)."""
    candidates = [model.get_decoder()] if hasattr(model, "get_decoder") else []
    candidates += [getattr(model, "model", None), model]
    for c in candidates:
        if c is not None and isinstance(getattr(c, "layers", None), nn.ModuleList):
            return c
    raise ModelError(f"cannot find the decoder layers of {type(model).__name__} (looked for `.layers` on its decoder)")


def checkpoint_keys(path: Path) -> dict[str, Path]:
    """Tensor name -> safetensors file, from the index or the single file."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return {k: path / f for k, f in json.loads(index.read_text())["weight_map"].items()}
    single = path / "model.safetensors"
    if single.is_file():
        with safe_open(single, framework="pt") as f:
            return {k: single for k in f.keys()}
    raise FileNotFoundError(f"{path} has no model.safetensors(.index.json): the split placement reads the target's "
                            "embedding and lm_head from safetensors weights (convert the checkpoint with save_pretrained)")


def forward_with_layer_states(model: PreTrainedModel, **kwargs) -> tuple[object, tuple[Tensor, ...]]:
    """`model(**kwargs, output_hidden_states=True)` and the residual stream after each decoder layer, embeddings
    first: HF's `hidden_states`, with the last entry the last layer's own output (what `TargetCapture` captures and
    the engines read) instead of HF's, which comes after the final norm. Decoding and replay read the drafter's
    target layers here, so that a drafter of the last layer sees what it trained on."""
    last: dict[str, Tensor] = {}

    def keep(_module, _args, out) -> None:
        last["out"] = out[0] if isinstance(out, tuple) else out

    hook = decoder_of(model).layers[-1].register_forward_hook(keep)
    try:
        out = model(**kwargs, output_hidden_states=True)
    finally:
        hook.remove()
    return out, (*out.hidden_states[:-1], last["out"])
