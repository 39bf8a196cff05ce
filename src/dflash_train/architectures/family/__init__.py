"""The block-drafter family: what the architectures built on the block drafter share; each architecture's package is
a member that subclasses these parts and adds its own.

- `reference_fields.py`: the reference config fields (output multiplier, softcap, input scale, reduced vocabulary,
  each layer's attention kind);
- `config.py`: the reference config layout (from the target's, from and to config.json);
- `blocks.py`: anchors, blocks, same-position labels, counted slots, slot weights;
- `mask.py`: the one mask predicate (dense and flex forms);
- `backend.py`: the training attention backend (flex block-sparse on CUDA, dense sdpa elsewhere);
- `layers.py`: the decoder layers (Qwen3-style, KV injection of the context);
- `model.py`: `BlockDrafter`, the drafter the members subclass;
- `loss.py`: the chunked lm_head + weighted cross-entropy (full logits never exist);
- `objective.py`: `BlockObjective`, a micro-batch's capture, blocks, forward and CE, which the members' objectives
  subclass;
- `serving.py` (torch-free, for the members' `options.py`): the engines' DFlash serving arguments and the
  full-vocabulary note.
"""
