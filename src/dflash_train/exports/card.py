"""An exported drafter's model card (its README.md), written here only: at the end of training, by
`dflash-train export`, and extended by `eval --update-card` and the demo's plots."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from ..architectures import registry
from ..architectures.io import drafter_config_text
from ..files.io import write_text_atomic
from ..files.layout import CONFIG_NAME
from ..infer.evaluate import markdown_table
from ..infer.replay import ARGMAX_MODE
from .serving import card_section, serving_of

CARD_NAME = "README.md"
_EVAL_HEADING = "\n## Evaluation (speculative decoding)\n"


def weights_line(step: int, best_tau: Optional[float], best_step: Optional[int]) -> str:
    """Which weights an export holds and why: the best checkpoint by validation tau, or the last step's."""
    if best_step is None:
        return f"the last step's ({step}; no validation ran, so there is no best checkpoint)"
    if best_step == step:
        return f"the last step's ({step}), which is also the best by validation tau ({best_tau:.3f})"
    return (f"the best checkpoint by validation tau: step {best_step} (tau {best_tau:.3f}) of the {step} trained; "
            f"`dflash-train export RUN/checkpoints/step-{step}` exports the last step's")


def title(name: str) -> str:
    """The card's first line: the architecture as it names itself (`Serving.title`), else its registry name."""
    s = serving_of(name)
    return f"# {s.title if s else name} drafter\n"


def drafter_card(drafter: Any, dtype: str, target: Optional[str], weights: str = "",
                 checkpoint: Optional[Path] = None, record: Optional[Mapping[str, Any]] = None,
                 cfg_yaml: Optional[str] = None) -> str:
    """An export's model card, written by the end of training and by `dflash-train export` (`checkpoint`: the one
    it exported): which weights, the target (as the run named it) and how the drafter reads it, the last logged
    training step (`record`), how each engine serves it (`serving.card_section`, for its block size and its
    config.json in `dtype`), what its files hold, and the training config."""
    config_json = json.loads(drafter_config_text(drafter, dtype))  # what the export's config.json holds
    s = serving_of(drafter.architecture)
    kind = s.title if s else drafter.architecture
    origin = f"; exported by `dflash-train export` from `{checkpoint}`" if checkpoint else ""
    facts = ([f"weights: {weights}"] if weights else []) + [
        f"target: `{target}`" if target else "target: not recorded (no dflash_train.json or config.yaml beside it)",
        f"target layer ids: {list(drafter.target_layer_ids)}",
        f"mask token id: {drafter.mask_token_id}",
        f"block size: {drafter.block_size}"]
    if record and "loss" in record:
        facts.append(f"last logged training step: {record.get('step')}, loss {record['loss']:.4f}, accuracy "
                     f"{record.get('accuracy', float('nan')):.3f}, tau estimate "
                     f"{record.get('tau_estimate', float('nan')):.3f}")
    serve = card_section(drafter.architecture, drafter.block_size, config_json)
    return (title(drafter.architecture) + f"\nA {kind} speculative-decoding drafter trained with dflash-train"
            f"{origin}.\n\n"
            + "".join(f"- {fact}\n" for fact in facts)
            + ("\n" + serve if serve else "")
            + "\n" + _files(config_json, s.reference if s else "")
            + (f"\n## Training config\n\n```yaml\n{cfg_yaml}```\n" if cfg_yaml else ""))


def _files(config_json: Mapping[str, Any], reference: str) -> str:
    n = config_json.get("draft_vocab_size")
    head = (f"its own `lm_head.weight` over {n} target tokens, mapped back through `d2t` (target id = draft id + "
            "d2t[draft id])" if n else "no lm_head either (the target's)")
    return ("## Files\n\n`config.json` + `model.safetensors`: no embedding (the target's), " + head + ". "
            "`dflash_train.json` records what it was trained against: `dflash-train eval --drafter DIR --target "
            "TARGET` decodes it and refuses a target with another tokenizer, chat template or RoPE"
            + (f". Reference code that loads it: {reference}" if reference else "") + ".\n")


def put_eval_table(drafter_dir: Path, report: dict) -> None:
    """Put the eval table into the drafter's card (replacing an earlier one)."""
    card = drafter_dir / CARD_NAME
    text = card.read_text() if card.is_file() else _folder_title(drafter_dir)
    text = text.split(_EVAL_HEADING)[0].rstrip() + "\n" + _EVAL_HEADING
    c = report["config"]
    how = ("Tau by replay (`dflash-train eval --replay`: the tau of greedy speculative decoding, not timed)"
           if c.get("method") == "replay" else "Produced by `dflash-train eval`")
    truncation = (f", drafts verified up to the first of confidence below {c['confidence_threshold']}"
                  if c.get("confidence_threshold") else "")
    argmax = (f" `{ARGMAX_MODE}`: the same turns drafted with the backbone's own argmax at every slot, without the "
              "reranker: what the reranker adds (replay only; no engine drafts that way)."
              if any(ARGMAX_MODE in body["modes"] for body in report["datasets"].values()) else "")
    text += (f"\nGreedy={c['temperature'] <= 0}, temperature {c['temperature']}, {c['max_new_tokens']} new tokens, "
             f"block size {c['block_size']}{truncation}. {how}.{argmax}\n\n" + markdown_table(report) + "\n")
    write_text_atomic(card, text)


def _folder_title(drafter_dir: Path) -> str:
    """A card's title for a folder without one, from its config.json's architecture."""
    config = json.loads((drafter_dir / CONFIG_NAME).read_text())
    return title(registry.entry_of_export(config).name)


def link_images(drafter_dir: Path, images: Sequence[Path]) -> None:
    """Link images that sit beside the card (e.g. training curves) at its end, each once."""
    card = drafter_dir / CARD_NAME
    text = card.read_text()
    links = [f"![{p.stem}]({p.name})" for p in images if f"]({p.name})" not in text]
    if links:
        write_text_atomic(card, text + "\n" + "".join(link + "\n" for link in links))
