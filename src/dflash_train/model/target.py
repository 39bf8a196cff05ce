"""The frozen target: load any local HF causal LM (multimodal configs resolve to their text model)
and capture the outputs of `target_layer_ids` without running later layers or the lm_head."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PretrainedConfig, PreTrainedModel

from .drafter_config import text_config

log = logging.getLogger(__name__)

# Checkpoint prefixes of multimodal families whose text model we load on its own.
_MULTIMODAL_KEY_MAPPING = {
    r"^model\.language_model\.": "model.",
    r"^language_model\.model\.": "model.",
    r"^language_model\.lm_head\.": "lm_head.",
}


def read_target_config(path: str | Path, trust_remote_code: bool = False) -> PretrainedConfig:
    """The target's text config, from config.json alone (no weights): used to validate early."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path}/config.json not found: the target must be a local Hugging Face model folder")
    return text_config(AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code))


def _is_multimodal(config: PretrainedConfig) -> bool:
    return text_config(config) is not config


def load_target_model(
    path: str | Path, dtype: torch.dtype, device: torch.device, trust_remote_code: bool = False
) -> PreTrainedModel:
    """Load the causal LM of `path`, frozen and in eval mode. A multimodal checkpoint loads its text
    model class (never the vision wrapper), mapping the checkpoint's prefixed weight names."""
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    kwargs: dict = dict(dtype=dtype, trust_remote_code=trust_remote_code)
    if _is_multimodal(config):
        tc = text_config(config)
        model_cls = AutoModelForCausalLM._model_mapping.get(type(tc), None)
        if model_cls is not None:
            log.info("target %s is multimodal (%s); loading its text model %s", path, type(config).__name__, model_cls.__name__)
            model = model_cls.from_pretrained(path, config=tc, key_mapping=_MULTIMODAL_KEY_MAPPING, **kwargs)
        else:
            # No text-only class in transformers: load the whole model; capture reads its language model.
            from transformers import AutoModelForImageTextToText

            log.info("target %s is multimodal (%s) with no text-only class; loading it whole (vision weights unused)",
                     path, type(config).__name__)
            model = AutoModelForImageTextToText.from_pretrained(path, **kwargs)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    model.to(device)
    model.eval()
    model.requires_grad_(False)
    return model


def decoder_of(model: PreTrainedModel) -> nn.Module:
    """The module that owns the decoder layer list (e.g. LlamaModel)."""
    candidates = [model.get_decoder()] if hasattr(model, "get_decoder") else []
    candidates += [getattr(model, "model", None), model]
    for c in candidates:
        if c is not None and isinstance(getattr(c, "layers", None), nn.ModuleList):
            return c
    raise ValueError(f"cannot find the decoder layers of {type(model).__name__} (looked for `.layers` on its decoder)")


class _CaptureDone(Exception):
    """Raised by the hook on the last needed layer: the rest of the forward never runs."""


@dataclass
class TargetCapture:
    """A target read up to its last needed layer; `__call__` returns `[B, S, K*H]`. The model stays
    whole (speculative decoding during training uses it), but a capture stops the forward right after
    the last captured layer: later layers, the final norm and the lm_head never run."""

    model: PreTrainedModel
    layer_ids: list[int]
    embed_tokens: nn.Module
    lm_head: nn.Linear
    num_layers: int
    hidden_size: int

    @classmethod
    def from_model(cls, model: PreTrainedModel, layer_ids: list[int]) -> "TargetCapture":
        tc = text_config(model.config)
        decoder = decoder_of(model)
        num_layers = len(decoder.layers)
        if max(layer_ids) >= num_layers:
            raise ValueError(f"target_layer_ids {layer_ids} exceed the target's {num_layers} layers")
        return cls(model, list(layer_ids), model.get_input_embeddings(), model.get_output_embeddings(),
                   num_layers, tc.hidden_size)

    @torch.no_grad()
    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Right-padded `input_ids [B, S]`: causal attention means padding never reaches a real token,
        so no attention mask is passed (the fast causal kernels stay usable)."""
        captured: dict[int, torch.Tensor] = {}
        decoder = decoder_of(self.model)
        last = max(self.layer_ids)
        hooks = []
        for lid in self.layer_ids:
            def hook(_m, _inp, out, lid=lid):
                captured[lid] = out[0] if isinstance(out, tuple) else out
                if lid == last:
                    raise _CaptureDone
            hooks.append(decoder.layers[lid].register_forward_hook(hook))
        try:
            decoder(input_ids=input_ids, use_cache=False)
        except _CaptureDone:
            pass
        finally:
            for h in hooks:
                h.remove()
        return torch.cat([captured[lid] for lid in self.layer_ids], dim=-1)


def load_tokenizer(path: str | Path, trust_remote_code: bool = False):
    tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def default_mask_token_id(tokenizer, suggestion: Optional[int] = None) -> int:
    """A token the model never emits in normal text. Order: the target folder's documented choice,
    a `<|MASK|>`/`<mask>` token in the vocabulary. Never pad or eos (often the same id)."""
    if suggestion is not None:
        return int(suggestion)
    vocab = tokenizer.get_vocab()
    for name in ("<|MASK|>", "<mask>", "<|mask|>", "[MASK]"):
        if name in vocab:
            return int(vocab[name])
    raise ValueError(
        "no mask token found in the target's tokenizer (looked for <|MASK|>, <mask>, [MASK]); set "
        "drafter.mask_token_id to a special token the model never emits in normal text (not pad or eos)"
    )
