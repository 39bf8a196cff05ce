"""The Domino drafter config: DFlash's, plus the correction's fields in `dflash_config` (the names SGLang reads).

Checkpoints and exports alike are the layout SGLang serves: `architectures: ["DFlashDraftModel"]`, told apart from
a DFlash drafter by `dflash_config.projector_type: "domino"` (the registry's export mark for this architecture)."""

from __future__ import annotations

from typing import Any

from transformers import PretrainedConfig, Qwen3Config

from ...errors import ConfigError
from ..family.config import drafter_config_from_dict, drafter_config_json, make_drafter_config, reference_fields
from .options import options_of

HF_ARCHITECTURE = "DFlashDraftModel"
PROJECTOR_TYPE = "domino"
FIELDS = ("projector_type", "shift_label", "pure_draft_prefix_len", "gru_hidden_dim", "emb_dim")


def make_domino_config(target_config: PretrainedConfig, *, gru_hidden_dim: int = 1024, emb_dim: int = 256,
                       pure_draft_prefix_len: int = 1, **dflash: Any) -> Qwen3Config:
    """The family's config (`make_drafter_config`, whose keyword arguments pass through) with Domino's fields."""
    cfg = make_drafter_config(target_config, **dflash)
    cfg.dflash_config.update(projector_type=PROJECTOR_TYPE, shift_label=True,
                             pure_draft_prefix_len=int(pure_draft_prefix_len), gru_hidden_dim=int(gru_hidden_dim),
                             emb_dim=int(emb_dim))
    cfg.emb_dim = int(emb_dim)  # also at the top level, where SpecForge and ModelOpt write it
    return cfg


def config_for_run(target_config: PretrainedConfig, run_cfg, target_layer_ids: list[int],
                   mask_token_id: int) -> Qwen3Config:
    d, o = run_cfg.drafter, options_of(run_cfg)
    if d.draft_vocab_size:
        raise ConfigError("config key 'drafter.draft_vocab_size': Domino's correction spans the target's whole "
                          "vocabulary; set drafter.draft_vocab_size=0")
    return make_domino_config(
        target_config, gru_hidden_dim=o.gru_hidden_dim, emb_dim=o.emb_dim,
        pure_draft_prefix_len=o.pure_draft_prefix_len, num_draft_layers=d.num_draft_layers,
        block_size=d.block_size, target_layer_ids=target_layer_ids, mask_token_id=mask_token_id,
        intermediate_size=d.intermediate_size, num_attention_heads=d.num_attention_heads,
        num_key_value_heads=d.num_key_value_heads, head_dim=d.head_dim, **reference_fields(d),
    )


def check_domino_fields(data: dict[str, Any]) -> None:
    """What SGLang's reader requires of a Domino config.json, checked as it does (a ValueError that names each key)."""
    dflash = data.get("dflash_config")
    if not isinstance(dflash, dict):
        raise ValueError("not a Domino drafter config: missing dflash_config")
    missing = [f"dflash_config.{k}" for k in FIELDS if k not in dflash]
    if missing:
        raise ValueError(f"not a Domino drafter config: missing {', '.join(missing)}")
    if dflash["projector_type"] != PROJECTOR_TYPE:
        raise ValueError(f"dflash_config.projector_type must be 'domino' (got {dflash['projector_type']!r})")
    if dflash["shift_label"] is not True:
        raise ValueError(f"dflash_config.shift_label: this version reads the shift_label=true layout only (got "
                         f"{dflash['shift_label']!r})")
    block = int(data.get("block_size", dflash.get("block_size", 0)))
    prefix = dflash["pure_draft_prefix_len"]
    if not isinstance(prefix, int) or not 1 <= prefix < block:
        raise ValueError(f"dflash_config.pure_draft_prefix_len must be an integer in 1..block_size-1 (got {prefix!r})")
    if "emb_dim" in data and data["emb_dim"] != dflash["emb_dim"]:
        raise ValueError(f"emb_dim {data['emb_dim']} differs from dflash_config.emb_dim {dflash['emb_dim']}")


def domino_config_from_dict(data: dict[str, Any]) -> Qwen3Config:
    """A Domino drafter config from a config.json (`DFlashDraftModel` with `dflash_config.projector_type:
    domino`), checked as SGLang checks it."""
    check_domino_fields(data)
    cfg = drafter_config_from_dict(data, HF_ARCHITECTURE)
    cfg.emb_dim = int(cfg.dflash_config["emb_dim"])
    return cfg


def domino_config_json(drafter, dtype: str) -> dict[str, Any]:
    """DFlash's config.json with Domino's fields in `dflash_config` and `emb_dim` at the top level too (SpecForge
    and ModelOpt write both; SGLang refuses them differing). No `auto_map`: SGLang builds the model itself."""
    data = drafter_config_json(drafter, dtype)
    data["architectures"] = [HF_ARCHITECTURE]
    data["emb_dim"] = int(drafter.config.dflash_config["emb_dim"])
    data.pop("auto_map", None)
    check_domino_fields(data)
    return data
