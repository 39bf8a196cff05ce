"""An exported drafter's model card (its README.md), written here only: at the end of training, by
`dflash-train export`, and extended by `eval --update-card` and the demo's plots."""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

from .infer.evaluate import markdown_table
from .runtime import write_text_atomic

CARD_NAME = "README.md"
_TITLE = "# DFlash drafter\n"
_EVAL_HEADING = "\n## Evaluation (speculative decoding)\n"
_LOADING = "Load it with the reference DFlash code or a serving engine's DFlash support"


def weights_line(step: int, best_tau: Optional[float], best_step: Optional[int]) -> str:
    """Which weights an export holds and why: the best checkpoint by validation tau, or the last step's."""
    if best_step is None:
        return f"the last step's ({step}; no validation ran, so there is no best checkpoint)"
    if best_step == step:
        return f"the last step's ({step}), which is also the best by validation tau ({best_tau:.3f})"
    return (f"the best checkpoint by validation tau: step {best_step} (tau {best_tau:.3f}) of the {step} trained; "
            f"`dflash-train export RUN/checkpoints/step-{step}` exports the last step's")


def serving_line(serving: Optional[dict]) -> str:
    """How many speculative tokens to serve it with (`target.provenance.serving_record`), as a card line."""
    if not serving:
        return ""
    n = serving["num_speculative_tokens"]
    return (f"- serve with {n} speculative tokens per step ({serving['architecture']}, block size "
            f"{serving['block_size']}): vLLM `num_speculative_tokens: {n}`, SGLang "
            f"`--speculative-num-draft-tokens {n + 1}`\n")


def training_card(cfg_yaml: str, target_path: Path, layer_ids: list[int], mask_token_id: int, summary: dict,
                  weights: str = "", serving: Optional[dict] = None) -> str:
    return (
        _TITLE + "\n"
        "A block-diffusion speculative-decoding drafter trained with dflash-train.\n\n"
        + (f"- weights: {weights}\n" if weights else "")
        + serving_line(serving)
        + f"- target: `{target_path}`\n"
        f"- target layer ids: {layer_ids}\n"
        f"- mask token id: {mask_token_id}\n"
        f"- steps: {summary.get('step')}, final loss {summary.get('loss', float('nan')):.4f}, "
        f"accuracy {summary.get('accuracy', float('nan')):.3f}, tau estimate {summary.get('tau_estimate', float('nan')):.3f}\n\n"
        f"{_LOADING} "
        "(config.json + model.safetensors, no embedding: the target's; the lm_head is the target's too, unless "
        "config.json has a `draft_vocab_size`: then the drafter scores that many target tokens with its own "
        "`lm_head.weight` and maps them back through `d2t` (target id = draft id + d2t[draft id]), which vLLM "
        "loads and SGLang's DFlash, using the target's head, does not).\n\n"
        "## Training config\n\n```yaml\n" + cfg_yaml + "```\n"
    )


def export_card(checkpoint: Path, weights: str = "", serving: Optional[dict] = None) -> str:
    return (_TITLE + f"\nExported by `dflash-train export` from `{checkpoint}`"
            + (f": {weights}" if weights else "") + ".\n\n" + (serving_line(serving) + "\n" if serving else "") +
            "Load with the reference DFlash code or a serving engine's DFlash support.\n")


def put_eval_table(drafter_dir: Path, report: dict) -> None:
    """Put the eval table into the drafter's card (replacing an earlier one)."""
    card = drafter_dir / CARD_NAME
    text = card.read_text() if card.is_file() else _TITLE
    text = text.split(_EVAL_HEADING)[0].rstrip() + "\n" + _EVAL_HEADING
    c = report["config"]
    how = ("Tau by replay (`dflash-train eval --replay`: the tau of greedy speculative decoding, not timed)"
           if c.get("method") == "replay" else "Produced by `dflash-train eval`")
    truncation = (f", drafts verified up to the first of confidence below {c['confidence_threshold']}"
                  if c.get("confidence_threshold") else "")
    text += (f"\nGreedy={c['temperature'] <= 0}, temperature {c['temperature']}, {c['max_new_tokens']} new tokens, "
             f"block size {c['block_size']}{truncation}. {how}.\n\n" + markdown_table(report) + "\n")
    write_text_atomic(card, text)


def link_images(drafter_dir: Path, images: Sequence[Path]) -> None:
    """Link images that sit beside the card (e.g. training curves) at its end, each once."""
    card = drafter_dir / CARD_NAME
    text = card.read_text()
    links = [f"![{p.stem}]({p.name})" for p in images if f"]({p.name})" not in text]
    if links:
        write_text_atomic(card, text + "\n" + "".join(link + "\n" for link in links))
