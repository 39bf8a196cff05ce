"""Real exports (untrained weights) of every built-in drafter architecture for the tiny target, and of DSpark's
heads that change what it can decode: for the tests of what `eval` accepts before anything loads. Not a test
module."""

from __future__ import annotations

from pathlib import Path

# case -> (drafter.architecture, its config section or None)
EXPORTS = {
    "dflash": ("dflash", None),
    "dflash2": ("dflash2", None),
    "dspark": ("dspark", {"markov_rank": 4}),
    "dspark-no-confidence": ("dspark", {"markov_rank": 4, "confidence_head": False, "confidence_weight": 0.0}),
    "dspark-rnn": ("dspark", {"markov_rank": 4, "markov_head_type": "rnn"}),
    "domino": ("domino", None),
    "lilicorr": ("lilicorr", {"candidate_topk": 4, "head_hidden_size": 16, "head_num_layers": 1, "head_num_heads": 2,
                              "factor_dim": 8}),
}


def export_drafter(root: Path, target_dir: Path, case: str, block_size: int = 4):
    """(the export folder `root/case`, the drafter) of one `EXPORTS` case: one layer, target layers [1, 4], mask
    token 16."""
    from dflash_train.architectures import architecture
    from dflash_train.architectures.io import save_drafter
    from dflash_train.config.load import config_from_dict
    from dflash_train.target.capture import read_target_config

    arch, section = EXPORTS[case]
    cfg = config_from_dict({"drafter": {"architecture": arch, "block_size": block_size, "num_draft_layers": 1},
                            **({arch: section} if section else {})})
    built = architecture(arch)
    drafter = built.drafter_class(built.config_for_run(read_target_config(target_dir), cfg, [1, 4], 16))
    return Path(save_drafter(drafter, Path(root) / case, dtype="float32")), drafter
