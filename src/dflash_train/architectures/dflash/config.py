"""DFlash's drafter config: the family's reference layout (`family.config`), with a reduced draft vocabulary when
the run asks for one (`drafter.draft_vocab_size`)."""

from __future__ import annotations

from transformers import PretrainedConfig, Qwen3Config

from ..family.config import REFERENCE_ARCHITECTURE, make_drafter_config, reference_fields

HF_ARCHITECTURE = REFERENCE_ARCHITECTURE


def config_for_run(target_config: PretrainedConfig, cfg, target_layer_ids: list[int], mask_token_id: int) -> Qwen3Config:
    """The drafter config of a training run from its config's `drafter` section (`config.DrafterConfig`)."""
    d = cfg.drafter
    return make_drafter_config(
        target_config, num_draft_layers=d.num_draft_layers, block_size=d.block_size, target_layer_ids=target_layer_ids,
        mask_token_id=mask_token_id, intermediate_size=d.intermediate_size, num_attention_heads=d.num_attention_heads,
        num_key_value_heads=d.num_key_value_heads, head_dim=d.head_dim, draft_vocab_size=d.draft_vocab_size,
        **reference_fields(d),
    )
