"""Derive the drafter's Qwen3-style config from the target's text config."""

from __future__ import annotations

from typing import Any, Optional

from transformers import PretrainedConfig, Qwen3Config

from ...model.hf_config import text_config


def _rope_fields(target: PretrainedConfig) -> dict[str, Any]:
    params = getattr(target, "rope_parameters", None)
    if params:
        return {"rope_parameters": dict(params)}
    fields: dict[str, Any] = {"rope_theta": getattr(target, "rope_theta", 10000.0)}
    scaling = getattr(target, "rope_scaling", None)
    if scaling:
        fields["rope_scaling"] = dict(scaling)
    return fields


def make_drafter_config(
    target_config: PretrainedConfig,
    *,
    num_draft_layers: int,
    block_size: int,
    target_layer_ids: list[int],
    mask_token_id: int,
    intermediate_size: Optional[int] = None,
    num_attention_heads: Optional[int] = None,
    num_key_value_heads: Optional[int] = None,
    head_dim: Optional[int] = None,
) -> Qwen3Config:
    """The drafter copies the target's layer shape unless told otherwise; its hidden size is always
    the target's (it reads the target's embeddings and feeds the target's lm_head)."""
    t = text_config(target_config)
    heads = num_attention_heads or t.num_attention_heads
    head_dim = head_dim or getattr(t, "head_dim", None) or t.hidden_size // t.num_attention_heads
    num_kv = num_key_value_heads or min(getattr(t, "num_key_value_heads", None) or heads, heads)
    if heads % num_kv:
        raise ValueError(f"config keys 'drafter.num_attention_heads' / 'drafter.num_key_value_heads': {heads} query "
                         f"heads cannot share {num_kv} key/value heads evenly (the target has "
                         f"{t.num_attention_heads} / {getattr(t, 'num_key_value_heads', None)})")
    cfg = Qwen3Config(
        vocab_size=t.vocab_size,
        hidden_size=t.hidden_size,
        intermediate_size=intermediate_size or t.intermediate_size,
        num_hidden_layers=num_draft_layers,
        num_attention_heads=heads,
        num_key_value_heads=num_kv,
        head_dim=head_dim,
        hidden_act="silu",
        max_position_embeddings=getattr(t, "max_position_embeddings", 32768),
        rms_norm_eps=getattr(t, "rms_norm_eps", 1e-6),
        attention_bias=False,
        tie_word_embeddings=False,
        use_sliding_window=False,
        layer_types=["full_attention"] * num_draft_layers,
        bos_token_id=getattr(t, "bos_token_id", None),
        eos_token_id=getattr(t, "eos_token_id", None),
        **_rope_fields(t),
    )
    cfg.architectures = ["DFlashDraftModel"]
    cfg.block_size = block_size
    cfg.num_target_layers = t.num_hidden_layers
    cfg.target_model_type = getattr(t, "model_type", None)
    cfg.dflash_config = {
        "mask_token_id": int(mask_token_id),
        "target_layer_ids": [int(i) for i in target_layer_ids],
        "block_size": block_size,
    }
    return cfg


def config_for_run(target_config: PretrainedConfig, d, target_layer_ids: list[int], mask_token_id: int) -> Qwen3Config:
    """The drafter config of a training run from its `drafter` config section (`config.DrafterConfig`)."""
    return make_drafter_config(
        target_config, num_draft_layers=d.num_draft_layers, block_size=d.block_size, target_layer_ids=target_layer_ids,
        mask_token_id=mask_token_id, intermediate_size=d.intermediate_size, num_attention_heads=d.num_attention_heads,
        num_key_value_heads=d.num_key_value_heads, head_dim=d.head_dim,
    )


def drafter_config_from_dict(data: dict[str, Any], architecture: str = "DFlashDraftModel") -> Qwen3Config:
    """Rebuild a drafter config from an exported config.json, checking the DFlash fields."""
    missing = [k for k in ("block_size", "num_target_layers", "dflash_config") if k not in data]
    dflash: Optional[dict] = data.get("dflash_config")
    if isinstance(dflash, dict):
        missing += [f"dflash_config.{k}" for k in ("mask_token_id", "target_layer_ids") if k not in dflash]
    if missing:
        raise ValueError(f"not a DFlash drafter config: missing {', '.join(missing)}")
    if data.get("architectures") != [architecture]:
        raise ValueError(f"not a DFlash drafter config: architectures is {data.get('architectures')!r}")
    fields = {k: v for k, v in data.items() if k not in ("model_type", "transformers_version")}
    cfg = Qwen3Config(**fields)
    cfg.block_size = int(data["block_size"])
    cfg.num_target_layers = int(data["num_target_layers"])
    cfg.dflash_config = dict(dflash)
    return cfg


def drafter_config_json(drafter, dtype: str) -> dict[str, Any]:
    """The exported config.json: the reference DFlash fields, and rope fields old and new loaders read."""
    data = drafter.config.to_dict()
    data["architectures"] = list(drafter.config.architectures)
    data["model_type"] = "qwen3"
    data["dtype"] = dtype
    data["torch_dtype"] = dtype  # transformers 4.x name
    data["block_size"] = drafter.block_size
    data["num_target_layers"] = int(drafter.config.num_target_layers)
    data["dflash_config"] = dict(drafter.config.dflash_config)
    # Older loaders read rope_theta / rope_scaling; newer ones read rope_parameters.
    rope = data.get("rope_parameters") or {}
    if "rope_theta" not in data and "rope_theta" in rope:
        data["rope_theta"] = rope["rope_theta"]
        if rope.get("rope_type", "default") != "default":
            data["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    for key in ("id2label", "label2id", "_name_or_path", "transformers_version"):
        data.pop(key, None)
    return data
