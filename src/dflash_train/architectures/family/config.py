"""The block drafters' config: the reference layout (z-lab/dflash's `DFlashDraftModel` config.json: a Qwen3 config
with `block_size`, `num_target_layers` and `dflash_config`) derived from the target's text config, read back from an
exported config.json and written for an export. Each architecture adds its own fields to it."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Optional

from transformers import PretrainedConfig, Qwen3Config

from ...target.hf_config import text_config
from .reference_fields import OutputFields, draft_vocab_size_of, layer_kinds


# `architectures[0]` of the reference layout's config.json (an architecture that exports another name sets its own)
REFERENCE_ARCHITECTURE = "DFlashDraftModel"


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
    sliding_window: Optional[int] = None,
    causal: bool = False,
    output_multiplier: float = 1.0,
    final_logit_softcapping: Optional[float] = None,
    draft_vocab_size: int = 0,
) -> Qwen3Config:
    """The drafter copies the target's layer shape unless told otherwise; its hidden size is always
    the target's (it reads the target's embeddings and feeds the target's lm_head).

    `sliding_window`: every layer `sliding_attention` with that window (None: all `full_attention`);
    `causal`: in-block causal attention, exported as an explicit top-level `is_causal` either way (a reader's
    default when it is absent depends on the layer type). `output_multiplier` / `final_logit_softcapping`
    go into `dflash_config` when they are not the defaults (1.0 / off), where newer reference readers look.
    `draft_vocab_size` > 0: the drafter's own lm_head over that many target tokens (top-level `draft_vocab_size`,
    as vLLM reads it; 0 leaves it out: the target's vocabulary and lm_head)."""
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
        use_sliding_window=sliding_window is not None,
        sliding_window=sliding_window,
        # Older (Qwen2-rule) readers slide the layers from max_window_layers on: 0 = all of them.
        **({"max_window_layers": 0} if sliding_window is not None else {}),
        layer_types=["sliding_attention" if sliding_window is not None else "full_attention"] * num_draft_layers,
        bos_token_id=getattr(t, "bos_token_id", None),
        eos_token_id=getattr(t, "eos_token_id", None),
        **_rope_fields(t),
    )
    cfg.architectures = [REFERENCE_ARCHITECTURE]
    cfg.block_size = block_size
    cfg.num_target_layers = t.num_hidden_layers
    cfg.target_model_type = getattr(t, "model_type", None)
    cfg.is_causal = bool(causal)
    cfg.dflash_config = {
        "mask_token_id": int(mask_token_id),
        "target_layer_ids": [int(i) for i in target_layer_ids],
        "block_size": block_size,
    }
    if output_multiplier != 1.0:
        cfg.dflash_config["output_multiplier"] = float(output_multiplier)
    if final_logit_softcapping:
        cfg.dflash_config["final_logit_softcapping"] = float(final_logit_softcapping)
    if draft_vocab_size:
        cfg.draft_vocab_size = int(draft_vocab_size)
    OutputFields.of(cfg), layer_kinds(cfg), draft_vocab_size_of(cfg)  # the checks a reader makes
    return cfg


def reference_fields(d) -> dict[str, Any]:
    """The newer reference fields of the run's `drafter` section, as `make_drafter_config` takes them."""
    return {"sliding_window": d.sliding_window, "causal": d.causal, "output_multiplier": d.output_multiplier,
            "final_logit_softcapping": d.final_logit_softcapping}


def drafter_config_from_dict(data: dict[str, Any], architecture: str = REFERENCE_ARCHITECTURE) -> Qwen3Config:
    """Rebuild a drafter config from an exported config.json, checking the reference layout's fields."""
    missing = [k for k in ("block_size", "num_target_layers", "dflash_config") if k not in data]
    dflash: Optional[dict] = data.get("dflash_config")
    if isinstance(dflash, dict):
        missing += [f"dflash_config.{k}" for k in ("mask_token_id", "target_layer_ids") if k not in dflash]
    if missing:
        raise ValueError(f"not a DFlash drafter config: missing {', '.join(missing)}")
    if data.get("architectures") != [architecture]:
        raise ValueError(f"not a DFlash drafter config: architectures is {data.get('architectures')!r}")
    fields = {k: v for k, v in data.items() if k not in ("model_type", "transformers_version")}
    if "num_hidden_layers" in data:  # the attention fields checked as written, before Qwen3Config's own checks
        layer_kinds(SimpleNamespace(**data))
    cfg = Qwen3Config(**fields)
    if "sliding_attention" in (data.get("layer_types") or []):
        # The file's window as written: Qwen3Config drops it unless use_sliding_window is set, but layer_types
        # naming sliding layers is what the reference decoder acts on.
        cfg.sliding_window = data.get("sliding_window")
    cfg.block_size = int(data["block_size"])
    cfg.num_target_layers = int(data["num_target_layers"])
    cfg.dflash_config = dict(dflash)
    OutputFields.of(cfg), layer_kinds(cfg), draft_vocab_size_of(cfg)  # refuse unreadable fields here, where the file is named
    return cfg


def drafter_config_json(drafter, dtype: str) -> dict[str, Any]:
    """The exported config.json: the reference layout's fields, and rope fields old and new loaders read."""
    data = drafter.config.to_dict()
    data["architectures"] = list(drafter.config.architectures)
    data["model_type"] = "qwen3"
    data["dtype"] = dtype
    data["torch_dtype"] = dtype  # transformers 4.x name
    data["block_size"] = drafter.block_size
    data["num_target_layers"] = int(drafter.config.num_target_layers)
    data["dflash_config"] = dict(drafter.config.dflash_config)
    # The attention fields at the top level, where the reference reads them: is_causal explicitly whenever one
    # value holds for every layer (absent, a reader's default depends on the layer type).
    kinds = layer_kinds(drafter.config)
    data["layer_types"] = ["sliding_attention" if k.sliding_window is not None else "full_attention" for k in kinds]
    windows = {k.sliding_window for k in kinds} - {None}
    data["use_sliding_window"] = bool(windows)
    data["sliding_window"] = windows.pop() if windows else None
    causal = {k.causal for k in kinds}
    if len(causal) == 1:
        data["is_causal"] = causal.pop()
    # Older loaders read rope_theta / rope_scaling; newer ones read rope_parameters.
    rope = data.get("rope_parameters") or {}
    if "rope_theta" not in data and "rope_theta" in rope:
        data["rope_theta"] = rope["rope_theta"]
        if rope.get("rope_type", "default") != "default":
            data["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    for key in ("id2label", "label2id", "_name_or_path", "transformers_version"):
        data.pop(key, None)
    return data
