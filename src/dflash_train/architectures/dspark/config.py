"""The DSpark drafter config: the family's (`family.config.make_drafter_config`) with the head fields, and the exported
config.json in the layout vLLM and SGLang load: `architectures: ["Qwen3DSparkModel"]`, every DSpark field flat at
the top level (`block_size`, `mask_token_id`, `target_layer_ids`, `num_target_layers`, `markov_rank`,
`markov_head_type`, `enable_confidence_head`, `confidence_head_with_markov`), no `dflash_config`."""

from __future__ import annotations

from typing import Any

from transformers import PretrainedConfig, Qwen3Config

from ...errors import ConfigError
from ..family.config import drafter_config_from_dict, drafter_config_json, make_drafter_config, reference_fields
from .options import options_of

HF_ARCHITECTURE = "Qwen3DSparkModel"
HEAD_FIELDS = ("markov_rank", "markov_head_type", "enable_confidence_head", "confidence_head_with_markov")


def config_for_run(target_config: PretrainedConfig, run_cfg, target_layer_ids: list[int],
                   mask_token_id: int) -> Qwen3Config:
    d, o = run_cfg.drafter, options_of(run_cfg)
    if d.draft_vocab_size:
        raise ConfigError("config key 'drafter.draft_vocab_size': a reduced draft vocabulary is not implemented for "
                          "DSpark; leave it 0")
    if d.causal or d.sliding_window is not None or d.output_multiplier != 1.0 or d.final_logit_softcapping:
        raise ConfigError("config keys 'drafter.causal' / 'drafter.sliding_window' / 'drafter.output_multiplier' / "
                          "'drafter.final_logit_softcapping': DSpark's served layout has none of them; leave them at "
                          "their defaults")
    cfg = make_drafter_config(
        target_config, num_draft_layers=d.num_draft_layers, block_size=d.block_size,
        target_layer_ids=target_layer_ids, mask_token_id=mask_token_id, intermediate_size=d.intermediate_size,
        num_attention_heads=d.num_attention_heads, num_key_value_heads=d.num_key_value_heads, head_dim=d.head_dim,
        **reference_fields(d))
    cfg.architectures = [HF_ARCHITECTURE]
    cfg.markov_rank = int(o.markov_rank)
    cfg.markov_head_type = o.markov_head_type
    cfg.enable_confidence_head = bool(o.confidence_head)
    cfg.confidence_head_with_markov = bool(o.confidence_head_with_markov and o.markov_rank > 0)
    return cfg


def dspark_config_from_dict(data: dict[str, Any]) -> Qwen3Config:
    """An exported (flat) config.json -> the drafter config (DFlash's reader, its `dflash_config` rebuilt from the
    flat fields)."""
    missing = [k for k in ("mask_token_id", "target_layer_ids", "block_size", "num_target_layers", *HEAD_FIELDS)
               if k not in data]
    if missing:
        raise ValueError(f"not a DSpark drafter config: missing {', '.join(missing)}")
    if data["markov_head_type"] not in ("vanilla", "gated", "rnn"):
        raise ValueError(f"markov_head_type must be vanilla, gated or rnn (got {data['markov_head_type']!r})")
    dflash = {"mask_token_id": data["mask_token_id"], "target_layer_ids": data["target_layer_ids"],
              "block_size": data["block_size"]}
    rest = {k: v for k, v in data.items() if k not in ("mask_token_id", "target_layer_ids")}
    cfg = drafter_config_from_dict({**rest, "dflash_config": dflash}, HF_ARCHITECTURE)
    for k in HEAD_FIELDS:
        setattr(cfg, k, data[k])
    return cfg


def dspark_config_json(drafter, dtype: str) -> dict[str, Any]:
    data = drafter_config_json(drafter, dtype)
    dflash = data.pop("dflash_config")
    data["architectures"] = [HF_ARCHITECTURE]
    data["mask_token_id"] = int(dflash["mask_token_id"])
    data["target_layer_ids"] = [int(i) for i in dflash["target_layer_ids"]]
    data["tie_word_embeddings"] = False
    for k in HEAD_FIELDS:
        data[k] = getattr(drafter.config, k)
    return data
