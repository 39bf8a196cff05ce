"""LiLiCorr's own config keys: the `lilicorr:` section of a run config (override `lilicorr.candidate_topk=16`), their
ranges and cross-checks, and how the engines serve its exports. Torch-free: the config loader imports it before
anything heavy loads."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from ..family.serving import SGLANG_ARGUMENTS, VLLM_ARGUMENTS
from ..registry import Engine, Note, Options, Serving
from ...errors import ConfigError
from ...numbers import NON_NEGATIVE_NUMBER, POSITIVE_INT, POSITIVE_NUMBER, Rule

NAME = "lilicorr"
# The engines' lane group: SGLang's and vLLM's kernels take k candidates a slot, k a power of two up to this.
MAX_TOPK = 16


@dataclass
class LiLiCorrOptions:
    # Candidates k per slot: the backbone's k best tokens, among which the head picks. A power of two, at most 16
    # (SGLang's and vLLM's kernels refuse others).
    candidate_topk: int = 8
    # Width h of the head; 0 = as wide as the drafter (then the candidates' embeddings enter without a projection).
    head_hidden_size: int = 1024
    # Bidirectional attention layers over the lattice of (slot, candidate) nodes.
    head_num_layers: int = 2
    # Attention heads of those layers (head_hidden_size must be a multiple).
    head_num_heads: int = 8
    # The layers' MLP width, as a multiple of head_hidden_size (Linear, SiLU, Linear).
    mlp_ratio: float = 2.0
    # Width f of the factor vectors whose cosines score the transitions.
    factor_dim: int = 1024
    # eps of the factor vectors' normalisation.
    vector_eps: float = 1.0e-4
    # The fixed (not learned) scale of the cosine scores: the lattice's log-potentials lie in [-scale, scale].
    logit_scale: float = 8.0
    # Weight of the lattice's cross-entropy (the gold candidate given the gold predecessor). The four loss keys are
    # set together or not at all; unset: the shipped recipe (0.25, 0, 0.25, margin 2.0).
    w_ce: Optional[float] = None
    # Weight of the margin term relu(margin - gap), gap the gold's log-potential minus the best other's.
    w_margin: Optional[float] = None
    # Weight of the target penalty: the lattice's probability on candidates the target scores below the gold.
    w_pen: Optional[float] = None
    # The margin term's margin, in log-potential units (> 0 when w_margin > 0).
    margin: Optional[float] = None
    # The lattice terms train the backbone too, through the candidates' log-probabilities, the slot states and the
    # anchor row (the recipe: true). false: they train the head alone, on those inputs detached, so the backbone
    # learns from the block loss only, as a DFlash drafter's does (the step's FLOP count then includes the few
    # input gradients it no longer computes). Training's objective only: an on-policy stage trains the whole drafter
    # on the walk's own distribution.
    backbone_gradient: bool = True
    # "+conv": the family's grouped dynamic convolution before and after each attention and MLP sublayer of the
    # backbone, starting as the identity; the engines build it from conv_kernel_size and conv_group_size.
    conv: bool = False
    # The convolutions' taps (the recipe's 2). At most drafter.block_size. Read only with conv.
    conv_kernel_size: int = 2
    # Channels that share one dynamic tap (the recipe's 16); must divide the target's hidden size. Read only with conv.
    conv_group_size: int = 16


# The shipped recipe's (w_ce, w_margin, w_pen, margin) where the four loss keys are unset.
BASE_RECIPE = (0.25, 0.0, 0.25, 2.0)
LOSS_KEYS = ("w_ce", "w_margin", "w_pen", "margin")


def options_of(cfg: Any) -> LiLiCorrOptions:
    """The run's `lilicorr` section (its defaults for a config built without one, e.g. `Config()`)."""
    found = getattr(cfg, "options", None)
    return found if isinstance(found, LiLiCorrOptions) else LiLiCorrOptions()


def loss_weights(o: LiLiCorrOptions) -> tuple[float, float, float, float]:
    """(w_ce, w_margin, w_pen, margin) the run trains with: the keys when set, else the shipped recipe's."""
    values = [getattr(o, k) for k in LOSS_KEYS]
    if all(v is None for v in values):
        return BASE_RECIPE
    return tuple(float(v) for v in values)  # type: ignore[return-value]


def validate(cfg: Any) -> None:
    o = options_of(cfg)
    k = o.candidate_topk
    if k > MAX_TOPK or k & (k - 1):
        raise ConfigError(f"config key 'lilicorr.candidate_topk': must be a power of two up to {MAX_TOPK} (got {k}); "
                          "SGLang's and vLLM's kernels take no other")
    missing = [key for key in LOSS_KEYS if getattr(o, key) is None]
    if missing and len(missing) < len(LOSS_KEYS):
        raise ConfigError(f"config key 'lilicorr.{missing[0]}': the loss keys lilicorr.w_ce, w_margin, w_pen and "
                          f"margin are set together or not at all (unset: {', '.join(missing)}); set them all, or "
                          "none for the shipped recipe")
    w_ce, w_margin, w_pen, margin = loss_weights(o)
    if w_ce + w_margin + w_pen <= 0:
        raise ConfigError("config key 'lilicorr.w_ce': w_ce, w_margin and w_pen are all 0, so nothing trains the "
                          "head; give one of them a weight > 0")
    if w_margin > 0 and margin <= 0:
        raise ConfigError(f"config key 'lilicorr.margin': must be > 0 where lilicorr.w_margin > 0 (got {margin})")
    width = o.head_hidden_size
    if width and width % o.head_num_heads:
        raise ConfigError(f"config key 'lilicorr.head_num_heads': {o.head_num_heads} heads do not divide "
                          f"lilicorr.head_hidden_size {width}; pick a divisor")
    d = cfg.drafter
    if d.block_size < 2:
        raise ConfigError(f"config key 'drafter.block_size': LiLiCorr needs at least 2 slots (got {d.block_size})")
    if o.conv and o.conv_kernel_size > d.block_size:
        raise ConfigError(f"config key 'lilicorr.conv_kernel_size': must be between 1 and drafter.block_size="
                          f"{d.block_size} (got {o.conv_kernel_size})")
    if d.draft_vocab_size:
        raise ConfigError("config key 'drafter.draft_vocab_size': LiLiCorr drafts from the target's full vocabulary "
                          "(the engines refuse a reduced one); set drafter.draft_vocab_size=0")
    if d.causal:
        raise ConfigError("config key 'drafter.causal': LiLiCorr's exports are non-causal (TensorRT-LLM refuses "
                          "causal: true); set drafter.causal=false")
    if d.output_multiplier != 1.0 or d.final_logit_softcapping:
        raise ConfigError("config keys 'drafter.output_multiplier' / 'drafter.final_logit_softcapping': LiLiCorr's "
                          "candidates are the target head's plain log-probabilities; leave them at their defaults")
    if cfg.parallel.placement == "split":
        raise ConfigError("config key 'parallel.placement': LiLiCorr's target penalty reads the target's final hidden "
                          "states, which the split placement does not send to the drafter ranks; use "
                          "parallel.placement=colocated")
    if cfg.objective.distill_weight > 0:
        raise ConfigError("config key 'objective.distill_weight': LiLiCorr's block loss is the hard cross-entropy "
                          "(its target penalty reads the target's logits); set objective.distill_weight=0")


TREE_REFUSAL = ("--tree-budget (DDTree) grows a tree from per-slot candidate distributions; a LiLiCorr drafter scores "
                "transitions between adjacent slots' candidates and drafts by walking that lattice: evaluate it "
                "without --tree-budget")


def tree_refusal(config_json: dict) -> str:
    """Every LiLiCorr export refuses DDTree (`TREE_REFUSAL`)."""
    return TREE_REFUSAL


SERVING = Serving(
    title="LiLiCorr",
    anchor_drafts=False,
    engines=(
        Engine("vLLM", VLLM_ARGUMENTS, "num_speculative_tokens", notes=(
            Note("Model Runner V2 (selected automatically); no other draft length"),)),
        Engine("SGLang", SGLANG_ARGUMENTS, "--speculative-num-draft-tokens", count_with_anchor=True, notes=(
            Note("`--speculative-algorithm DFLASH`: the `LiLiCorrDraftModel` architecture selects the head"),
            Note("no other block size (or leave the count out)"))),
    ),
    reference="NVIDIA/Model-Optimizer",
)

OPTIONS = Options(
    section=LiLiCorrOptions,
    number_rules={"candidate_topk": POSITIVE_INT, "head_hidden_size": Rule(int, low=0, zero="0 = the drafter's width"),
                  "head_num_layers": POSITIVE_INT, "head_num_heads": POSITIVE_INT, "mlp_ratio": POSITIVE_NUMBER,
                  "factor_dim": POSITIVE_INT, "vector_eps": POSITIVE_NUMBER, "logit_scale": POSITIVE_NUMBER,
                  "w_ce": NON_NEGATIVE_NUMBER, "w_margin": NON_NEGATIVE_NUMBER, "w_pen": NON_NEGATIVE_NUMBER,
                  "margin": NON_NEGATIVE_NUMBER, "conv_kernel_size": POSITIVE_INT, "conv_group_size": POSITIVE_INT},
    validate=validate,
    about="LiLiCorr's lattice head over the backbone's candidates and its loss",
    # the recipe's block loss: exp(-(k - 1) / 7) with the generic gamma (7.0), not DFlash's default acceptance
    defaults={"objective.slot_weighting": "gamma"},
    tree_refusal=tree_refusal,
    on_policy=True,
    serving=SERVING,
)
