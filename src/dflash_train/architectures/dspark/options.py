"""DSpark's own config keys: the `dspark:` section of a run config (override `dspark.markov_rank=128`), their ranges
and cross-checks. Torch-free: the config loader imports it before anything heavy loads."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Optional

from ..registry import Engine, Note, Options, Serving
from ...errors import ConfigError
from ...numbers import NON_NEGATIVE_NUMBER, POSITIVE_NUMBER, Rule

NAME = "dspark"


@dataclass
class DSparkOptions:
    # Rank r of the Markov head (its two tables are [vocab, r]); 0 turns the head off. 256 in every published config.
    markov_rank: int = 256
    # vanilla: a bias from the previous token alone (the paper's); gated: that bias gated by the slot's hidden state;
    # rnn: a recurrent state over the block's previous tokens and hidden states. vLLM serves vanilla only.
    markov_head_type: Literal["vanilla", "gated", "rnn"] = "vanilla"
    # Train and export the confidence head (each slot's predicted acceptance, for confidence-based truncation).
    # Without it SGLang serves the export only in its default verify mode (SGLANG_RAGGED_VERIFY_MODE=static).
    confidence_head: bool = True
    # The confidence head reads the previous token's Markov embedding beside the slot's hidden state (needs
    # markov_rank > 0).
    confidence_head_with_markov: bool = True
    # Weight of the cross-entropy against the data's next token. Unset: 0.1 (the reference's) with dspark.loss
    # dspark, 0 with dpard (which replaces it).
    ce_weight: Optional[float] = None
    # Weight of the L1 distance between the drafter's and the target's distributions (the full L1, twice the total
    # variation). Unset: 0.9 (the reference's) with dspark.loss dspark, 0 with dpard (which replaces it).
    l1_weight: Optional[float] = None
    # Weight of the confidence head's BCE against the analytic acceptance 1 - L1/2 (1.0 in the reference).
    confidence_weight: float = 1.0
    # Slot k's loss weight is exp(-k / decay_gamma) (k = 0 for the anchor's own prediction): 4.0 in the reference
    # code, whatever the block size. DSpark weighs its slots so alone: objective.slot_weighting and
    # objective.gamma do not apply to it.
    decay_gamma: float = 4.0
    # dspark: ce_weight * CE + l1_weight * L1 (+ the confidence BCE), the paper's. dpard: D-PARD's actor instead, a
    # Renyi-1/2 divergence to the target per slot, weighted by the detached expected accepted length from that
    # slot on (from each slot's analytic acceptance), summed per sequence; ce_weight and l1_weight then stay unset
    # (or 0). The confidence BCE stays as it is, with the exp(-k / decay_gamma) weights.
    loss: Literal["dspark", "dpard"] = "dspark"
    # D-PARD's credit floor: slot i's factor is dpard_alpha + (1 - dpard_alpha) * its acceptance; strictly
    # between 0 and 1 (0.5 in SpecForge's D-PARD).
    dpard_alpha: float = 0.5
    # The CE and L1 terms' slot weights. decay: exp(-k / decay_gamma), the paper's. acceptance or dpace: DFlash's
    # (objective.slot_weighting's, with objective.acceptance_floor / objective.dpace_alpha), made of the drafter's
    # Markov-corrected probabilities of the labels from a gradient-free first pass through the chunked head; the
    # confidence BCE keeps the decay. Not with dspark.loss dpard, whose credit weighs the slots itself.
    slot_weights: Literal["decay", "acceptance", "dpace"] = "decay"


# (CE, L1) weights of each loss where dspark.ce_weight / dspark.l1_weight are unset
DEFAULT_LOSS_WEIGHTS = {"dspark": (0.1, 0.9), "dpard": (0.0, 0.0)}


def loss_weights(o: DSparkOptions) -> tuple[float, float]:
    """The (CE, L1) weights the run trains with: the keys where set, else the loss's defaults."""
    ce, l1 = DEFAULT_LOSS_WEIGHTS[o.loss]
    return (ce if o.ce_weight is None else float(o.ce_weight), l1 if o.l1_weight is None else float(o.l1_weight))


def options_of(cfg: Any) -> DSparkOptions:
    """The run's `dspark` section (its defaults for a config built without one, e.g. `Config()`)."""
    found = getattr(cfg, "options", None)
    return found if isinstance(found, DSparkOptions) else DSparkOptions()


def validate(cfg: Any) -> None:
    o = options_of(cfg)
    if o.markov_rank == 0 and o.markov_head_type != "vanilla":
        raise ConfigError(f"config key 'dspark.markov_head_type': {o.markov_head_type} needs a Markov head; "
                          "dspark.markov_rank is 0: set a rank > 0 or leave the type vanilla")
    if o.confidence_head and o.confidence_head_with_markov and o.markov_rank == 0:
        raise ConfigError("config key 'dspark.confidence_head_with_markov': needs dspark.markov_rank > 0; set it "
                          "false or give the Markov head a rank")
    if o.confidence_weight > 0 and not o.confidence_head:
        raise ConfigError(f"config key 'dspark.confidence_weight': {o.confidence_weight} weighs a confidence head "
                          "that dspark.confidence_head=false turns off; set it to 0 or turn the head on")
    ce, l1 = loss_weights(o)
    if o.loss == "dpard" and (ce or l1):
        raise ConfigError(f"config key 'dspark.loss': dpard replaces the CE and L1 terms (dspark.ce_weight {ce}, "
                          f"dspark.l1_weight {l1}); remove those keys, or leave dspark.loss dspark")
    if o.loss == "dspark" and ce + l1 <= 0:
        raise ConfigError("config key 'dspark.ce_weight': dspark.ce_weight and dspark.l1_weight are both 0, so "
                          "nothing trains the drafter's distribution; give one of them a weight > 0")
    if o.loss == "dpard" and o.slot_weights != "decay":
        raise ConfigError(f"config key 'dspark.slot_weights': {o.slot_weights} weighs the CE and L1 terms, which "
                          "dspark.loss dpard replaces (its credit weighs the slots); leave it decay, or use "
                          "dspark.loss dspark")
    if cfg.objective.distill_weight > 0:
        raise ConfigError("config key 'objective.distill_weight': DSpark has its own term against the target's "
                          "distribution (dspark.l1_weight); set objective.distill_weight to 0")


def tree_refusal(config_json: dict) -> Optional[str]:
    """An rnn Markov head's bias depends on every token drafted before the slot: no per-parent tree scores. The
    exported config.json's flat `markov_rank` and `markov_head_type` (`config.HEAD_FIELDS`) say."""
    if config_json.get("markov_rank") and config_json.get("markov_head_type") == "rnn":
        return ("--tree-budget (DDTree) scores each tree node given its parent token only; this DSpark drafter's "
                "markov_head_type is rnn, whose bias depends on every token drafted before the slot: evaluate it "
                "without --tree-budget (vanilla and gated heads support it)")
    return None


def confidence_head(config_json: dict) -> bool:
    """Whether the export carries the confidence head (`enable_confidence_head`, `dspark.confidence_head`)."""
    return bool(config_json.get("enable_confidence_head"))


def _no_markov_head(config_json: dict) -> bool:
    return not config_json.get("markov_rank")


def _gated_or_rnn(config_json: dict) -> bool:
    return bool(config_json.get("markov_rank")) and config_json.get("markov_head_type", "vanilla") != "vanilla"


SERVING = Serving(
    title="DSpark",
    anchor_drafts=True,
    engines=(
        Engine("vLLM", """--speculative-config '{"method": "dspark", "model": "{dir}", """
                       """"num_speculative_tokens": {count}}'""", "num_speculative_tokens",
               notes=(Note("vanilla Markov heads only (`dspark.markov_head_type`)", _gated_or_rnn, refuses=True),)),
        Engine("SGLang", "--speculative-algorithm DSPARK --speculative-draft-model-path {dir} "
                         "--speculative-num-draft-tokens {count}", "--speculative-num-draft-tokens",
               count_with_anchor=True, notes=(
                   Note("a Markov head (`dspark.markov_rank` > 0)", _no_markov_head, refuses=True),
                   # SGLang builds the confidence head in every verify mode but the default, whatever
                   # enable_confidence_head says, and then needs its weights
                   Note("without the confidence head (`dspark.confidence_head: false`), only in SGLang's default "
                        "verify mode (`SGLANG_RAGGED_VERIFY_MODE=static`): its confidence-driven modes need the head's "
                        "weights", lambda c: not confidence_head(c)))),
    ),
    reference="deepseek-ai/DeepSpec",
)

OPTIONS = Options(
    section=DSparkOptions,
    number_rules={"markov_rank": Rule(int, low=0, zero="0 = no Markov head"), "ce_weight": NON_NEGATIVE_NUMBER,
                  "l1_weight": NON_NEGATIVE_NUMBER, "confidence_weight": NON_NEGATIVE_NUMBER,
                  "decay_gamma": POSITIVE_NUMBER,
                  "dpard_alpha": Rule(float, low=0, high=1, low_open=True, high_open=True)},
    validate=validate,
    about="DSpark's Markov and confidence heads and its loss",
    confidence_head=confidence_head,
    tree_refusal=tree_refusal,
    on_policy=True,
    serving=SERVING,
)
