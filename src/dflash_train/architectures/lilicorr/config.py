"""The LiLiCorr drafter config: the family's reference layout (`family.config`) with the head's fields in
`dflash_config`, and the exported config.json the engines load: `architectures: ["LiLiCorrDraftModel"]`,
`dflash_config` with `projector_type: lilicorr`, `lilicorr_enabled: true`, every `lilicorr_*` field (the loaders
have no defaults for them), `causal: false` and `block_size` (also at the top level); with `lilicorr.conv`, also
`conv_kernel_size` and `conv_group_size`, from which the engines build the layers' convolutions."""

from __future__ import annotations

from typing import Any

from transformers import PretrainedConfig, Qwen3Config

from ...errors import ConfigError
from ...target.hf_config import text_config
from ..family.config import drafter_config_from_dict, drafter_config_json, make_drafter_config, reference_fields
from ..family.conv import CONV_FIELDS
from .options import MAX_TOPK, options_of

HF_ARCHITECTURE = "LiLiCorrDraftModel"
PROJECTOR = "lilicorr"
# dflash_config's head fields, each read off the run's `lilicorr` section
HEAD_FIELDS = ("lilicorr_candidate_topk", "lilicorr_hidden_size", "lilicorr_num_layers", "lilicorr_num_heads",
               "lilicorr_mlp_ratio", "lilicorr_factor_dim", "lilicorr_vector_eps", "lilicorr_logit_scale")
_TYPES = {"lilicorr_mlp_ratio": float, "lilicorr_vector_eps": float, "lilicorr_logit_scale": float}


def head_fields(dflash_config: dict) -> dict[str, Any]:
    """The head's fields of a `dflash_config`, typed; a missing or unusable one raises (as the engines do)."""
    missing = [k for k in HEAD_FIELDS if k not in dflash_config]
    if missing:
        raise ValueError(f"not a LiLiCorr drafter config: dflash_config lacks {', '.join(missing)}")
    out = {k: _TYPES.get(k, int)(dflash_config[k]) for k in HEAD_FIELDS}
    k = out["lilicorr_candidate_topk"]
    if k < 1 or k > MAX_TOPK or k & (k - 1):
        raise ValueError(f"dflash_config.lilicorr_candidate_topk must be a power of two up to {MAX_TOPK} (got {k})")
    return out


def config_for_run(target_config: PretrainedConfig, run_cfg, target_layer_ids: list[int],
                   mask_token_id: int) -> Qwen3Config:
    d, o = run_cfg.drafter, options_of(run_cfg)
    width = o.head_hidden_size or text_config(target_config).hidden_size
    if width % o.head_num_heads:
        raise ConfigError(f"config key 'lilicorr.head_num_heads': {o.head_num_heads} heads do not divide the "
                          f"head's width {width} (lilicorr.head_hidden_size 0: the target's); pick a divisor")
    cfg = make_drafter_config(
        target_config, num_draft_layers=d.num_draft_layers, block_size=d.block_size,
        target_layer_ids=target_layer_ids, mask_token_id=mask_token_id, intermediate_size=d.intermediate_size,
        num_attention_heads=d.num_attention_heads, num_key_value_heads=d.num_key_value_heads, head_dim=d.head_dim,
        **reference_fields(d))
    cfg.architectures = [HF_ARCHITECTURE]
    cfg.dflash_config.update({
        "causal": False, "projector_type": PROJECTOR, "lilicorr_enabled": True,
        "lilicorr_candidate_topk": int(o.candidate_topk), "lilicorr_hidden_size": int(o.head_hidden_size),
        "lilicorr_num_layers": int(o.head_num_layers), "lilicorr_num_heads": int(o.head_num_heads),
        "lilicorr_mlp_ratio": float(o.mlp_ratio), "lilicorr_factor_dim": int(o.factor_dim),
        "lilicorr_vector_eps": float(o.vector_eps), "lilicorr_logit_scale": float(o.logit_scale)})
    if o.conv:
        if cfg.hidden_size % o.conv_group_size:
            raise ConfigError(f"config key 'lilicorr.conv_group_size': {o.conv_group_size} does not divide the "
                              f"target's hidden size {cfg.hidden_size}; pick a divisor (16 in the recipe)")
        cfg.dflash_config.update(conv_kernel_size=int(o.conv_kernel_size), conv_group_size=int(o.conv_group_size))
    return cfg


def lilicorr_config_from_dict(data: dict[str, Any]) -> Qwen3Config:
    """An exported config.json -> the drafter config (the reference layout's reader, the head's fields checked)."""
    cfg = drafter_config_from_dict(data, HF_ARCHITECTURE)
    own = cfg.dflash_config
    if own.get("projector_type") != PROJECTOR or own.get("lilicorr_enabled") is not True:
        raise ValueError("not a LiLiCorr drafter config: dflash_config needs projector_type 'lilicorr' and "
                         "lilicorr_enabled true")
    head_fields(own)
    present = [k for k in CONV_FIELDS if k in own]
    if present and len(present) < len(CONV_FIELDS):
        raise ValueError(f"a LiLiCorr drafter config with convolutions needs both {' and '.join(CONV_FIELDS)} in "
                         f"dflash_config (it has only {present[0]})")
    return cfg


def lilicorr_config_json(drafter, dtype: str) -> dict[str, Any]:
    data = drafter_config_json(drafter, dtype)
    data["architectures"] = [HF_ARCHITECTURE]
    data["tie_word_embeddings"] = False
    own = data["dflash_config"]
    own["block_size"] = data["block_size"] = int(drafter.block_size)
    own["causal"] = False
    own.update(drafter.lilicorr.exported_fields())  # read off the built head
    return data
