"""Decoding and replay read the drafter's target layers as training captures them: the residual stream after each
layer, the target's last layer too (HF reports that one after the final norm, which training never sees)."""

from __future__ import annotations

import torch

from dflash_train.architectures import architecture
from dflash_train.config.load import config_from_dict
from dflash_train.infer.replay import target_pass
from dflash_train.infer.spec_decode import SpeculativeDecoder, new_cache
from dflash_train.target.capture import TargetCapture, load_target_model
from dflash_train.target.hf_model import forward_with_layer_states


def test_every_layer_state_is_the_captured_one_the_last_layer_too(tiny_target_dir):
    target = load_target_model(tiny_target_dir, torch.float64, torch.device("cpu"))
    last = target.config.num_hidden_layers - 1
    ids = torch.randint(3, 1000, (1, 17), generator=torch.Generator().manual_seed(0))
    captured, _ = TargetCapture.from_model(target, [1, last]).capture(ids)
    out, states = forward_with_layer_states(target, input_ids=ids, use_cache=False)
    assert len(states) == len(out.hidden_states) == last + 2
    torch.testing.assert_close(torch.cat([states[2], states[last + 1]], -1), captured, rtol=0, atol=0)
    assert not torch.allclose(out.hidden_states[last + 1], states[last + 1])  # HF's last entry: after the final norm
    replayed, argmax = target_pass(target, ids[0].tolist())
    torch.testing.assert_close(torch.cat([replayed[2], replayed[last + 1]], -1), captured, rtol=0, atol=0)
    assert torch.equal(argmax, out.logits[0].argmax(-1))

    arch = architecture("dflash")
    cfg = config_from_dict({"drafter": {"block_size": 4, "num_draft_layers": 1}})
    drafter = arch.drafter_class(arch.config_for_run(target.config, cfg, [1, last], 16)).double()
    decoder = SpeculativeDecoder(target, drafter)
    _, hidden = decoder._target(ids[0], torch.arange(17), new_cache())
    torch.testing.assert_close(hidden, captured[0], rtol=1e-12, atol=1e-12)
