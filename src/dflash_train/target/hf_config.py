"""Reading Hugging Face configs the same way everywhere."""

from __future__ import annotations

from transformers import PretrainedConfig


def text_config(config: PretrainedConfig) -> PretrainedConfig:
    """The language-model part of a (possibly multimodal) config."""
    getter = getattr(config, "get_text_config", None)
    return getter(decoder=True) if getter is not None else config
