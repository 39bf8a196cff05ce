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


def _model_class(config: PretrainedConfig) -> tuple[type, PretrainedConfig]:
    """The class that loads this target, and the config to build it from: a multimodal checkpoint
    loads its text model class when transformers has one, else the whole model (vision unused)."""
    if not _is_multimodal(config):
        return AutoModelForCausalLM, config
    tc = text_config(config)
    text_cls = AutoModelForCausalLM._model_mapping.get(type(tc), None)
    if text_cls is not None:
        return text_cls, tc
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText, config


def load_target_model(
    path: str | Path, dtype: torch.dtype, device: torch.device, trust_remote_code: bool = False
) -> PreTrainedModel:
    """Load the causal LM of `path`, frozen and in eval mode. A multimodal checkpoint loads its text
    model class (never the vision wrapper), mapping the checkpoint's prefixed weight names."""
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    kwargs: dict = dict(dtype=dtype, trust_remote_code=trust_remote_code)
    model_cls, build_config = _model_class(config)
    if build_config is not config:
        log.info("target %s is multimodal (%s); loading its text model %s", path, type(config).__name__, model_cls.__name__)
        model = model_cls.from_pretrained(path, config=build_config, key_mapping=_MULTIMODAL_KEY_MAPPING, **kwargs)
    else:
        if _is_multimodal(config):  # no text-only class in transformers: capture reads its language model
            log.info("target %s is multimodal (%s) with no text-only class; loading it whole (vision weights unused)",
                     path, type(config).__name__)
        model = model_cls.from_pretrained(path, **kwargs)
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
    the last captured layer: later layers, the final norm and the lm_head never run. `capture(...,
    with_final=True)` runs them all but the lm_head (distillation needs what feeds the lm_head)."""

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

    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.capture(input_ids)[0]

    @torch.no_grad()
    def capture(self, input_ids: torch.Tensor, with_final: bool = False) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Right-padded `input_ids [B, S]` -> (`[B, S, K*H]` captured layers, the final normed hidden state
        `[B, S, H]` when `with_final`, else None). Causal attention means padding never reaches a real
        token, so no attention mask is passed (the fast causal kernels stay usable)."""
        captured: dict[int, torch.Tensor] = {}
        decoder = decoder_of(self.model)
        stop_at = None if with_final else max(self.layer_ids)
        hooks = []
        for lid in self.layer_ids:
            def hook(_m, _inp, out, lid=lid):
                captured[lid] = out[0] if isinstance(out, tuple) else out
                if lid == stop_at:
                    raise _CaptureDone
            hooks.append(decoder.layers[lid].register_forward_hook(hook))
        final = None
        try:
            out = decoder(input_ids=input_ids, use_cache=False)
            if with_final:  # HF decoders apply their final norm to last_hidden_state
                final = out[0] if isinstance(out, tuple) else out.last_hidden_state
        except _CaptureDone:
            pass
        finally:
            for h in hooks:
                h.remove()
        return torch.cat([captured[lid] for lid in self.layer_ids], dim=-1), final


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


@dataclass
class TargetHead:
    """What a drafter rank of a split placement needs from the target: the input embedding (block
    tokens) and the lm_head (the loss). The decoder layers live on the target ranks only."""

    embed_tokens: nn.Embedding
    lm_head: nn.Linear


def _checkpoint_keys(path: Path) -> dict[str, Path]:
    """Tensor name -> safetensors file, from the index or the single file."""
    import json

    index = path / "model.safetensors.index.json"
    if index.is_file():
        return {k: path / f for k, f in json.loads(index.read_text())["weight_map"].items()}
    single = path / "model.safetensors"
    if single.is_file():
        from safetensors import safe_open

        with safe_open(single, framework="pt") as f:
            return {k: single for k in f.keys()}
    raise FileNotFoundError(f"{path} has no model.safetensors(.index.json): the split placement reads the target's "
                            "embedding and lm_head from safetensors weights (convert the checkpoint with save_pretrained)")


def _find_key(keys: dict[str, Path], name: str) -> Optional[str]:
    """The checkpoint key of the parameter `name` (e.g. model.embed_tokens.weight); multimodal
    checkpoints prefix the text model's names, so match on the module's own name when needed."""
    if name in keys:
        return name
    suffix = ".".join(name.split(".")[-2:])
    found = [k for k in keys if k == suffix or k.endswith("." + suffix)]
    if len(found) > 1:
        found = [k for k in found if "language_model" in k] or found
    return found[0] if len(found) == 1 else None


def load_target_head(path: str | Path, dtype: torch.dtype, device: torch.device,
                     trust_remote_code: bool = False) -> TargetHead:
    """The target's embedding and lm_head alone, read from its safetensors: a 27B target's decoder
    never touches a drafter rank's memory."""
    from safetensors import safe_open

    path = Path(path)
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    tc = text_config(config)
    model_cls, build_config = _model_class(config)
    with torch.device("meta"):  # the module tree names the two tensors; no weights are made
        if issubclass(model_cls, PreTrainedModel):  # a concrete text-model class
            skeleton = model_cls(build_config)
        else:  # an Auto class
            skeleton = model_cls.from_config(build_config, trust_remote_code=trust_remote_code)
    embed_param, head_param = skeleton.get_input_embeddings().weight, skeleton.get_output_embeddings().weight
    named = list(skeleton.named_parameters(remove_duplicate=False))
    embed_name = next(n for n, p in named if p is embed_param and "embed" in n)
    head_name = next((n for n, p in named if p is head_param and "embed" not in n), embed_name)
    keys = _checkpoint_keys(path)

    def read(name: str) -> Optional[torch.Tensor]:
        key = _find_key(keys, name)
        if key is None:
            return None
        with safe_open(keys[key], framework="pt") as f:
            return f.get_tensor(key).to(device=device, dtype=dtype)

    embed = read(embed_name)
    if embed is None:
        raise KeyError(f"the target's input embedding ({embed_name}) is not in {path}'s safetensors")
    head = read(head_name) if head_name != embed_name else None
    if head is None:
        if not getattr(tc, "tie_word_embeddings", False):
            raise KeyError(f"the target's lm_head ({head_name}) is not in {path}'s safetensors and its config does "
                           "not tie it to the embedding")
        head = embed
    embed_tokens = nn.Embedding(embed.shape[0], embed.shape[1], device="meta")
    embed_tokens.weight = nn.Parameter(embed, requires_grad=False)
    lm_head = nn.Linear(head.shape[1], head.shape[0], bias=False, device="meta")
    lm_head.weight = nn.Parameter(head, requires_grad=False)
    return TargetHead(embed_tokens, lm_head)
