"""`eval`'s decoding options, checked against each other and against the drafter's config.json before any model
loads: a combination the decoding would refuse only once the target is loaded (tens of seconds for a large one) is
refused here in one line. What an architecture supports comes from its declared `registry.Options`
(`confidence_head`, `tree_refusal`), read from the config.json without weights or torch."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from ..architectures import registry
from ..errors import ModelError
from ..files.layout import CONFIG_NAME
from ..files.io import read_json_file


@dataclass(frozen=True)
class DecodingOptions:
    """The flags of one `eval` that decide what is decoded (their ranges are the parser's)."""

    tree_budgets: tuple[int, ...] = ()
    confidence_threshold: float = 0.0
    temperature: float = 0.0
    block_size: Optional[int] = None
    replay: bool = False


def check_flags(o: DecodingOptions) -> None:
    """The flags among themselves."""
    twice = sorted({b for b in o.tree_budgets if o.tree_budgets.count(b) > 1})
    if twice:
        raise ValueError(f"--tree-budget lists {twice[0]} twice: give each budget once")
    if o.replay and o.temperature > 0:
        raise ValueError("--replay measures greedy decoding: drop --temperature (or --replay to sample)")
    if o.replay and o.confidence_threshold > 0:
        raise ValueError("--replay verifies every draft: drop --confidence-threshold (or --replay)")
    if o.tree_budgets and o.temperature > 0:
        raise ValueError("--tree-budget: DDTree verification is greedy; drop --temperature (or --tree-budget)")
    if o.tree_budgets and o.confidence_threshold > 0:
        raise ValueError("--confidence-threshold truncates block verification; DDTree verifies a tree: drop "
                         "--tree-budget or --confidence-threshold")


def read_export_config(drafter: Path) -> tuple[registry.Registered, dict]:
    """(the registered architecture, the parsed config.json) of an exported drafter folder; a config.json no
    architecture exports, or a damaged one, raises a user error naming the file."""
    path = Path(drafter) / CONFIG_NAME
    data = read_json_file(path, "export the checkpoint again (dflash-train export RUN/checkpoints/step-N --out DIR) "
                                "or copy the drafter folder again")
    if not isinstance(data, dict):
        raise ModelError(f"{path}: not a drafter config (a JSON object); export the checkpoint again")
    try:
        return registry.entry_of_export(data), data
    except registry.NotAnExport as e:
        raise ModelError(f"{path}: {e}") from None


def check_against_drafter(o: DecodingOptions, drafter: Path) -> None:
    """The flags against what the drafter in `drafter` (an exported folder) supports: DDTree, a confidence head,
    its trained block size."""
    entry, config = read_export_config(drafter)
    where = Path(drafter) / CONFIG_NAME
    declared = registry.options(entry.name)
    if o.tree_budgets and declared.tree_refusal is not None:
        why = declared.tree_refusal(config)
        if why:
            raise ValueError(f"{drafter}: {why}")
    if o.confidence_threshold > 0 and not (declared.confidence_head and declared.confidence_head(config)):
        raise ValueError(f"--confidence-threshold {o.confidence_threshold:g}: the {entry.name} drafter in {drafter} "
                         f"has no confidence head (its {CONFIG_NAME} declares none); drop --confidence-threshold")
    trained = config.get("block_size")
    if o.block_size is None or not isinstance(trained, int):
        return
    if o.replay and o.block_size != trained:
        raise ValueError(f"--replay verifies the drafter's trained block ({trained}, {where}); drop --block-size "
                         f"{o.block_size} or --replay")
    if o.block_size > trained:
        raise ValueError(f"--block-size {o.block_size}: larger than the drafter's trained block size {trained} "
                         f"({where}); give at most {trained} or leave --block-size out")
