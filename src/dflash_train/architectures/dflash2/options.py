"""DFlash2's own config keys: the `dflash2:` section of a run config (override `dflash2.selector_top_k=64`), their
ranges and cross-checks, and the old flat names they had under `drafter.` and `objective.`.

Torch-free, like the package's `__init__`: the config loader imports this module (through the registry,
`registry.options`) to read and check a config before anything heavy loads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from ..registry import Engine, Note, Options, Serving
from ...errors import ConfigError
from ...numbers import NON_NEGATIVE_NUMBER, POSITIVE_INT, POSITIVE_NUMBER
from ..family.serving import FULL_VOCABULARY, SGLANG_ARGUMENTS, VLLM_ARGUMENTS

NAME = "dflash2"


@dataclass
class DFlash2Options:
    # The block-local convolutions' taps (the reference's 2). At most drafter.block_size.
    conv_kernel_size: int = 2
    # Channels that share one dynamic convolution tap (the reference's 16); must divide the target's hidden size.
    conv_group_size: int = 16
    # Rank of the candidate selector's pair scores (its codebooks are [vocab, rank]).
    selector_rank: int = 256
    # Candidates per slot the selector chooses among (the unary logits' top-k): the reference's values are kept but
    # 32 candidates, +1.3% block tau over 16 at equal steps, 64 no better, the same 8B step time
    # (docs/results/quality.md).
    selector_top_k: int = 32
    # The candidate selector's learning rate over optim.lr. Its pair term is a product of three small factors at the
    # identity start (two codebooks, one of them zero, and the hidden projection), so at the common rate it takes
    # many steps to reach the unary logits' scale. Measured at 3 and 10: the selector fits the training batches
    # better and decodes worse (docs/results/quality.md), so 1 stays the default.
    selector_lr_scale: float = 1.0
    # The selector's two [vocab, rank] codebooks. free: trained tables (the reference's layout). factored: each is
    # the target's lm_head rows times a trained [hidden -> rank] projection, so an update to one token's pairs moves
    # the pairs of tokens with similar lm_head rows too (a free row moves only when its token occurs); checkpoints
    # hold the projections, the export the tables computed from them (the reference layout either way). Measured
    # (docs/results/quality.md): the tau of free tables (1.774 against 1.777 block), 0.8 GiB less at the 8B shape;
    # with selector_rows=all it collapses (1.410: the forced-in labels pull the shared projections).
    selector_codebooks: Literal["free", "factored"] = "free"
    # Weight of the selector's loss next to the unary slot loss.
    selector_loss_weight: float = 1.0
    # The counted slots the selector's loss is taken over. covered: only those whose label is among the top-k
    # already, the slots where decoding can pick it (the rest add 0; the loss keeps the unary loss's normaliser, so
    # it scales with the coverage). all: every one, the label forced into the candidates where the top-k misses it
    # (the public ports' practice): a label decoding can never pick, whose loss (~10 nats at the start) pushes the
    # drafter's hidden states; measured worse (1.755 against 1.777 block tau, unary accuracy 0.188 against 0.196;
    # docs/results/quality.md).
    selector_rows: Literal["all", "covered"] = "covered"
    # With objective.slot_weighting acceptance or dpace: whose probability of each label the weights are made of.
    # unary: the unary logits' softmax (as DFlash); selector: softmax(S) over the slot's candidates with the label
    # forced in, given the true previous token (decoding's chance of the label where it is among the unary top-k;
    # outside them decoding never drafts it, yet the weight counts it at the forced-in value).
    acceptance_from: Literal["unary", "selector"] = "unary"


def options_of(cfg: Any) -> DFlash2Options:
    """The run's `dflash2` section (its defaults for a config built without one, e.g. `Config()`)."""
    found = getattr(cfg, "options", None)
    return found if isinstance(found, DFlash2Options) else DFlash2Options()


def validate(cfg: Any) -> None:
    """The cross-checks of the section against the rest of the run's config."""
    o = options_of(cfg)
    block = cfg.drafter.block_size
    if o.conv_kernel_size > block:
        raise ConfigError(f"config key 'dflash2.conv_kernel_size': must be between 1 and drafter.block_size={block} "
                          f"(got {o.conv_kernel_size})")
    if o.acceptance_from == "selector" and cfg.objective.slot_weighting not in ("acceptance", "dpace"):
        raise ConfigError(f"config key 'dflash2.acceptance_from': selector chooses the probabilities of "
                          f"slot_weighting acceptance or dpace; objective.slot_weighting is "
                          f"{cfg.objective.slot_weighting!r}")
    if o.selector_codebooks == "factored" and getattr(getattr(cfg, "onpolicy", None), "start_from", ""):
        raise ConfigError("config key 'dflash2.selector_codebooks': the on-policy stage (onpolicy.start_from) "
                          "continues an export, whose selector holds free tables (the factored codebooks computed "
                          "once); set dflash2.selector_codebooks=free")


def training_layout(config_json: dict) -> bool:
    """Factored selector codebooks (`dflash_config.selector_codebooks: factored`): a checkpoint holds the
    projections, which the export turns into the reference's tables with the target's lm_head."""
    return (config_json.get("dflash_config") or {}).get("selector_codebooks") == "factored"


SERVING = Serving(
    title="DFlash2",
    anchor_drafts=False,
    engines=(
        Engine("vLLM", VLLM_ARGUMENTS, "num_speculative_tokens", notes=(
            Note("vLLM's V2 model runner only (`VLLM_USE_V2_MODEL_RUNNER=1`): the V1 runner silently runs it as plain "
                 "DFlash"),
            Note("an unquantized target lm_head"), FULL_VOCABULARY)),
        Engine("SGLang", SGLANG_ARGUMENTS, "--speculative-num-draft-tokens", count_with_anchor=True,
               notes=(Note("SGLang main (`DFlash2DraftModel`)"), FULL_VOCABULARY)),
    ),
)

OPTIONS = Options(
    section=DFlash2Options,
    number_rules={"conv_kernel_size": POSITIVE_INT, "conv_group_size": POSITIVE_INT, "selector_rank": POSITIVE_INT,
                  "selector_top_k": POSITIVE_INT, "selector_lr_scale": POSITIVE_NUMBER,
                  "selector_loss_weight": NON_NEGATIVE_NUMBER},
    validate=validate,
    aliases={**{f"drafter.{k}": k for k in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k",
                                            "selector_lr_scale", "selector_codebooks")},
             **{f"objective.{k}": k for k in ("selector_loss_weight", "selector_rows", "acceptance_from")}},
    about="DFlash2's block convolutions and candidate selector",
    training_layout=training_layout,
    on_policy=True,
    serving=SERVING,
)
