"""What DFlash declares without torch (the config loader imports this module through the registry,
`registry.options`): no config section of its own; it implements a reduced draft vocabulary
(`drafter.draft_vocab_size`); how the engines serve its exports (`SERVING`)."""

from __future__ import annotations

from typing import Any, Mapping

from ..family.serving import FULL_VOCABULARY, SGLANG_ARGUMENTS, VLLM_ARGUMENTS, reduced_vocabulary
from ..registry import Engine, Note, Options, Serving


def _output_fields_set(config_json: Mapping[str, Any]) -> bool:
    """An export whose logits or block inputs are scaled (`output_multiplier`, `final_logit_softcapping`,
    `input_embedding_scale` away from their defaults, in `dflash_config` or at the top level)."""
    own = config_json.get("dflash_config") or {}

    def value(key: str, default: Any) -> Any:
        return own.get(key, config_json.get(key, default))

    return (value("output_multiplier", 1.0) != 1.0 or bool(value("final_logit_softcapping", None))
            or value("input_embedding_scale", 1.0) != 1.0)


SERVING = Serving(
    title="DFlash",
    anchor_drafts=False,
    engines=(
        Engine("vLLM", VLLM_ARGUMENTS, "num_speculative_tokens", notes=(
            Note("reads a reduced draft vocabulary (`drafter.draft_vocab_size`)", reduced_vocabulary),
            Note("`output_multiplier`, `final_logit_softcapping` and `input_embedding_scale` at their defaults (its "
                 "DFlash loader ignores them)", _output_fields_set, refuses=True))),
        Engine("SGLang", SGLANG_ARGUMENTS, "--speculative-num-draft-tokens", count_with_anchor=True,
               notes=(FULL_VOCABULARY,)),
    ),
    reference="z-lab/dflash",
)

OPTIONS = Options(draft_vocabulary=True, on_policy=True, serving=SERVING)
