"""The DFlash2 drafter config: DFlash's, plus the convolution and selector fields in `dflash_config`."""

from __future__ import annotations

from typing import Any

from transformers import PretrainedConfig, Qwen3Config

from ...errors import ConfigError
from ..family.config import drafter_config_from_dict, drafter_config_json, make_drafter_config, reference_fields
from .options import options_of

HF_ARCHITECTURE = "DFlash2DraftModel"
FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")  # the reference requires them


def make_dflash2_config(target_config: PretrainedConfig, *, conv_kernel_size: int = 2, conv_group_size: int = 16,
                        selector_rank: int = 256, selector_top_k: int = 32, selector_codebooks: str = "free",
                        **dflash: Any) -> Qwen3Config:
    """The family's config (`make_drafter_config`, whose keyword arguments pass through) with the DFlash2 fields.
    `selector_codebooks=factored` is written into `dflash_config` (a training checkpoint's layout; the export
    drops it with the projections: `DFlash2Drafter.materialized`); free, the reference's, is not written."""
    cfg = make_drafter_config(target_config, **dflash)
    cfg.architectures = [HF_ARCHITECTURE]
    cfg.dflash_config.update(conv_kernel_size=int(conv_kernel_size), conv_group_size=int(conv_group_size),
                             selector_rank=int(selector_rank), selector_top_k=int(selector_top_k))
    if selector_codebooks != "free":
        cfg.dflash_config["selector_codebooks"] = selector_codebooks
    return cfg


def config_for_run(target_config: PretrainedConfig, run_cfg, target_layer_ids: list[int],
                   mask_token_id: int) -> Qwen3Config:
    """From the run's `drafter` and `dflash2` sections; the keys that depend on the target's shape are checked
    here, before any weight loads."""
    d, o = run_cfg.drafter, options_of(run_cfg)
    cfg = make_dflash2_config(
        target_config, conv_kernel_size=o.conv_kernel_size, conv_group_size=o.conv_group_size,
        selector_rank=o.selector_rank, selector_top_k=o.selector_top_k, selector_codebooks=o.selector_codebooks,
        num_draft_layers=d.num_draft_layers,
        block_size=d.block_size, target_layer_ids=target_layer_ids, mask_token_id=mask_token_id,
        intermediate_size=d.intermediate_size, num_attention_heads=d.num_attention_heads,
        num_key_value_heads=d.num_key_value_heads, head_dim=d.head_dim, **reference_fields(d),
    )
    if cfg.hidden_size % o.conv_group_size:
        raise ConfigError(f"config key 'dflash2.conv_group_size': {o.conv_group_size} does not divide the target's "
                          f"hidden size {cfg.hidden_size}; pick a divisor (16 in the reference)")
    if o.selector_top_k > cfg.vocab_size:
        raise ConfigError(f"config key 'dflash2.selector_top_k': {o.selector_top_k} is more than the vocabulary "
                          f"({cfg.vocab_size})")
    return cfg


def dflash2_config_from_dict(data: dict[str, Any]) -> Qwen3Config:
    """Rebuild a DFlash2 drafter config from an exported config.json (block_size may sit in dflash_config only,
    as in published DFlash2 drafters)."""
    dflash = data.get("dflash_config")
    if isinstance(dflash, dict):
        missing = [f"dflash_config.{k}" for k in FIELDS if k not in dflash]
        if missing:
            raise ValueError(f"not a DFlash2 drafter config: missing {', '.join(missing)}")
        if dflash.get("selector_codebooks", "free") not in ("free", "factored"):
            raise ValueError(f"dflash_config.selector_codebooks must be free or factored (got "
                             f"{dflash['selector_codebooks']!r})")
        if "block_size" not in data and "block_size" in dflash:
            data = {**data, "block_size": dflash["block_size"]}
    return drafter_config_from_dict(data, HF_ARCHITECTURE)


def dflash2_config_json(drafter, dtype: str) -> dict[str, Any]:
    """DFlash's config.json with `architectures: ["DFlash2DraftModel"]` and every DFlash2 field in
    `dflash_config` (block_size included: published DFlash2 loaders read it there)."""
    data = drafter_config_json(drafter, dtype)
    data["architectures"] = [HF_ARCHITECTURE]
    data["dflash_config"] = {"block_size": drafter.block_size, "output_multiplier": drafter.output_multiplier,
                             "final_logit_softcapping": drafter.final_logit_softcapping, **data["dflash_config"]}
    return data
