"""Small LiLiCorr drafters for tests outside its own package, and the same backbone without the head. Not a test
module."""

from __future__ import annotations

import torch

from dflash_train.architectures import architecture
from dflash_train.config.load import config_from_dict


def perturbed_lilicorr(target_config, block_size: int, topk: int = 4, layer_ids=(1, 4), mask: int = 16,
                       scale: float = 0.3, seed: int = 0):
    """A one-layer LiLiCorr drafter with a 32-wide head whose parameters are moved off their init by `scale`, so
    that its walk leaves the backbone's argmax."""
    cfg = config_from_dict({"drafter": {"architecture": "lilicorr", "block_size": block_size, "num_draft_layers": 1},
                            "lilicorr": {"candidate_topk": topk, "head_hidden_size": 32, "head_num_layers": 1,
                                         "head_num_heads": 4, "factor_dim": 16}})
    torch.manual_seed(seed)
    arch = architecture("lilicorr")
    drafter = arch.drafter_class(arch.config_for_run(target_config, cfg, list(layer_ids), mask))
    with torch.no_grad():
        for p in drafter.lilicorr.parameters():
            p.add_(torch.randn_like(p) * scale)
    return drafter


def backbone_alone(drafter, target_config):
    """A DFlash drafter holding every backbone weight of the LiLiCorr `drafter` (not its head), in its dtype: it
    drafts the backbone's argmax."""
    cfg = config_from_dict({"drafter": {"architecture": "dflash", "block_size": drafter.block_size,
                                        "num_draft_layers": len(drafter.layers)}})
    arch = architecture("dflash")
    plain = arch.drafter_class(arch.config_for_run(target_config, cfg, list(drafter.target_layer_ids),
                                                   drafter.mask_token_id))
    own = plain.state_dict()
    plain.load_state_dict({k: v for k, v in drafter.state_dict().items() if k in own}, strict=True)
    return plain.to(next(drafter.parameters()).dtype).eval()
