"""Domino's own config keys: the `domino:` section of a run config (override `domino.gru_hidden_dim=512`), their
ranges and cross-checks.

Torch-free, like the package's `__init__`: the config loader imports this module to read and check a config before
anything heavy loads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..registry import Engine, Note, Options, Serving
from ...errors import ConfigError
from ...numbers import FRACTION, POSITIVE_INT
from ..family.serving import FULL_VOCABULARY, SGLANG_ARGUMENTS

NAME = "domino"


@dataclass
class DominoOptions:
    # Hidden size G of the GRU over the target's embeddings of the block's previous tokens (1024 in every released
    # configuration).
    gru_hidden_dim: int = 1024
    # Bottleneck E of the logit correction: [slot hidden ; GRU state] (H + G) -> E -> SiLU -> vocabulary (256 in
    # every released configuration).
    emb_dim: int = 256
    # Leading slots drafted from the backbone's logits alone; the correction acts from this slot on. SGLang serves
    # 1 only. Below drafter.block_size.
    pure_draft_prefix_len: int = 1
    # Weight of the base loss (the uncorrected logits' cross-entropy) at step 0: loss = (1 - l) * final + l * base.
    # Between 0 and 1.
    lambda_base_start: float = 1.0
    # Share of the run's steps over which the base weight falls linearly to 0 (the released recipes' 1.0: the
    # whole run). Between 0 and 1; 0 gives weight 0 from the first step.
    lambda_base_decay_ratio: float = 1.0


def options_of(cfg: Any) -> DominoOptions:
    """The run's `domino` section (its defaults for a config built without one, e.g. `Config()`)."""
    found = getattr(cfg, "options", None)
    return found if isinstance(found, DominoOptions) else DominoOptions()


def validate(cfg: Any) -> None:
    """The cross-checks of the section against the rest of the run's config."""
    o = options_of(cfg)
    block = cfg.drafter.block_size
    if block < 2:
        raise ConfigError(f"config key 'drafter.block_size': Domino needs at least 2 slots (got {block})")
    if o.pure_draft_prefix_len >= block:
        raise ConfigError(f"config key 'domino.pure_draft_prefix_len': must be below drafter.block_size={block} "
                          f"(got {o.pure_draft_prefix_len}); SGLang serves 1")
    # (the schema refuses any other value first; this keeps a weighting added there later from reaching Domino's
    # objective unchecked)
    if cfg.objective.slot_weighting not in ("gamma", "acceptance", "dpace"):
        raise ConfigError(f"config key 'objective.slot_weighting': Domino weighs its slots by gamma, acceptance or "
                          f"dpace (got {cfg.objective.slot_weighting!r})")
    if cfg.objective.distill_weight > 0:
        raise ConfigError("config key 'objective.distill_weight': Domino trains on the dataset's tokens (hard "
                          "labels); set objective.distill_weight=0")
    if cfg.drafter.draft_vocab_size:
        raise ConfigError("config key 'drafter.draft_vocab_size': Domino's correction spans the target's whole "
                          "vocabulary; set drafter.draft_vocab_size=0")


TREE_REFUSAL = ("drafter.architecture domino drafts a chain: its correction depends on every token before the slot, "
                "so per-slot tree candidates would not be the distributions it drafts from; evaluate it without "
                "--tree-budget")


def tree_refusal(config_json: dict) -> str:
    """Every Domino export refuses DDTree (`TREE_REFUSAL`)."""
    return TREE_REFUSAL


def _not_bf16(config_json: dict) -> bool:
    return config_json.get("dtype", config_json.get("torch_dtype", "bfloat16")) != "bfloat16"


def _longer_pure_prefix(config_json: dict) -> bool:
    return (config_json.get("dflash_config") or {}).get("pure_draft_prefix_len", 1) != 1


SERVING = Serving(
    title="Domino",
    anchor_drafts=False,  # SGLang's rollout drafts B - 1 and verifies B, as eval does (the reference's drafts B)
    engines=(
        Engine("vLLM", unsupported="not supported upstream"),
        Engine("SGLang", SGLANG_ARGUMENTS, "--speculative-num-draft-tokens", count_with_anchor=True, notes=(
            Note("SGLang main reads `dflash_config.projector_type: domino`"),
            Note("greedy decoding on CUDA only"),
            Note("BF16 weights (`run.export_dtype`, `export --dtype`: bfloat16 by default)", _not_bf16, refuses=True),
            Note("`domino.pure_draft_prefix_len` 1", _longer_pure_prefix, refuses=True),
            FULL_VOCABULARY)),
    ),
)

OPTIONS = Options(
    section=DominoOptions,
    number_rules={"gru_hidden_dim": POSITIVE_INT, "emb_dim": POSITIVE_INT, "pure_draft_prefix_len": POSITIVE_INT,
                  "lambda_base_start": FRACTION, "lambda_base_decay_ratio": FRACTION},
    validate=validate,
    about="Domino's GRU logit correction and its base-loss schedule",
    # exp(-k / gamma) with the generic gamma (7.0, the reference recipes' loss_decay_gamma), not DFlash's default
    # acceptance; acceptance and dpace (of the corrected scores' label probabilities) are accepted, pending a GPU
    # comparison of the recipes
    defaults={"objective.slot_weighting": "gamma"},
    tree_refusal=tree_refusal,
    on_policy=True,
    serving=SERVING,
)
