"""`drafter.init_from_target`: start the drafter's decoder layers as copies of target decoder layers.

A drafter layer has the shape of a target layer (same hidden size and, by default, the same head
counts and MLP size), so its attention, MLP and both layer norms can start from the target's
trained weights instead of noise. The q/k norms are copied when the target has them (Qwen3) and
stay at 1 otherwise (Llama); the drafter's final `norm` starts as the target's final norm (the
drafter feeds the target's lm_head, as the target's last layer does). `fc` and `hidden_norm` have
no counterpart in the target and keep their fresh init.

Which target layers: drafter layer j of N copies target layer `init_layer_ids(L, N)[j]`, the last N
layers of the target, in order. The drafter's job is the target's last step: turn context features
into next-token hidden states for the target's own final norm and lm_head.

The tensors are read straight from the target's safetensors, so this works on a split-placement
drafter rank that never holds the target's decoder.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional

import torch
from safetensors import safe_open

from ..errors import ConfigError
from ..target.hf_model import checkpoint_keys

log = logging.getLogger(__name__)

# Per decoder layer: drafter parameter name -> target parameter name (HF Llama / Qwen2 / Qwen3 / Mistral ...).
LAYER_TENSORS = {
    "self_attn.q_proj.weight": "self_attn.q_proj.weight",
    "self_attn.k_proj.weight": "self_attn.k_proj.weight",
    "self_attn.v_proj.weight": "self_attn.v_proj.weight",
    "self_attn.o_proj.weight": "self_attn.o_proj.weight",
    "mlp.gate_proj.weight": "mlp.gate_proj.weight",
    "mlp.up_proj.weight": "mlp.up_proj.weight",
    "mlp.down_proj.weight": "mlp.down_proj.weight",
    "input_layernorm.weight": "input_layernorm.weight",
    "post_attention_layernorm.weight": "post_attention_layernorm.weight",
}
OPTIONAL_LAYER_TENSORS = {  # copied when the target has them, else left at their init (1)
    "self_attn.q_norm.weight": "self_attn.q_norm.weight",
    "self_attn.k_norm.weight": "self_attn.k_norm.weight",
}
_NOT_TEXT = ("vision", "visual", "audio", "mtp")


def init_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The target layers the drafter's layers start from: the last `num_draft_layers`, in order."""
    if num_draft_layers > num_target_layers:
        raise ConfigError(f"config key 'drafter.init_from_target': the drafter has {num_draft_layers} layers but the "
                          f"target only {num_target_layers} to copy them from; lower drafter.num_draft_layers or "
                          "set drafter.init_from_target=false")
    return list(range(num_target_layers - num_draft_layers, num_target_layers))


def _key_for(keys: dict[str, Path], name: str) -> Optional[str]:
    """The checkpoint key of a text-decoder parameter named `name` (e.g. `layers.3.mlp.up_proj.weight`),
    whatever prefix the model class puts in front (`model.`, `model.language_model.`, ...)."""
    found = [k for k in keys if k == name or k.endswith("." + name)]
    if len(found) > 1:
        found = [k for k in found if not any(t in k for t in _NOT_TEXT)] or found
    if len(found) > 1:
        found = [k for k in found if "language_model" in k] or found
    if len(found) > 1:
        raise ConfigError(f"config key 'drafter.init_from_target': the target's checkpoint has several tensors "
                          f"named like {name!r} ({', '.join(sorted(found)[:4])}); cannot tell which to copy")
    return found[0] if found else None


def _final_norm_key(keys: dict[str, Path]) -> Optional[str]:
    """The text decoder's final norm (`model.norm.weight` and the like), or None when unclear."""
    found = [k for k in keys if (k == "norm.weight" or k.endswith(".norm.weight")) and ".layers." not in k
             and not k.startswith("layers.") and not any(t in k for t in _NOT_TEXT)]
    if len(found) > 1:
        found = [k for k in found if "language_model" in k]
    return found[0] if len(found) == 1 else None


@torch.no_grad()
def init_drafter_from_target(drafter, target_path, layer_ids: Optional[list[int]] = None) -> list[int]:
    """Copy target decoder layers into `drafter` in place (see the module docstring). Returns the target
    layer ids used. Raises ConfigError, naming the tensor and both shapes, when a shape differs (a
    drafter narrowed with drafter.intermediate_size / num_attention_heads / ...)."""
    target_path = Path(target_path)
    cfg = drafter.config
    if layer_ids is None:
        layer_ids = init_layer_ids(int(cfg.num_target_layers), len(drafter.layers))
    if len(layer_ids) != len(drafter.layers):
        raise ConfigError(f"config key 'drafter.init_from_target': {len(layer_ids)} target layers given for "
                          f"{len(drafter.layers)} drafter layers")
    keys = checkpoint_keys(target_path)
    own = dict(drafter.named_parameters())
    plan: list[tuple[str, str]] = []  # (drafter name, checkpoint key)
    for j, lid in enumerate(layer_ids):
        for mine, theirs in {**LAYER_TENSORS, **OPTIONAL_LAYER_TENSORS}.items():
            key = _key_for(keys, f"layers.{lid}.{theirs}")
            if key is None:
                if mine in LAYER_TENSORS:
                    raise ConfigError(f"config key 'drafter.init_from_target': the target has no tensor "
                                      f"'layers.{lid}.{theirs}' in {target_path}; its layers are not the Llama/Qwen "
                                      "shape the drafter copies (set drafter.init_from_target=false)")
                continue
            plan.append((f"layers.{j}.{mine}", key))
        bias = _key_for(keys, f"layers.{lid}.self_attn.q_proj.bias")
        if bias is not None and j == 0:
            log.warning("drafter.init_from_target: the target's attention has biases; the drafter has none, so "
                        "they are not copied (the copied layers start close to, not equal to, the target's)")
    final_norm = _final_norm_key(keys)
    if final_norm is not None:
        plan.append(("norm.weight", final_norm))
    # Read and check every shape before touching the drafter: a refusal leaves it as it was.
    tensors: dict[str, torch.Tensor] = {}
    handles: dict[Path, object] = {}
    try:
        for mine, key in plan:
            f = handles.get(keys[key])
            if f is None:
                f = handles[keys[key]] = safe_open(keys[key], framework="pt").__enter__()
            shape = tuple(f.get_slice(key).get_shape())
            if shape != tuple(own[mine].shape):
                raise ConfigError(
                    f"config key 'drafter.init_from_target': target tensor {key} has shape {list(shape)} but the "
                    f"drafter's {mine} has {list(own[mine].shape)}; the drafter's layer shape must equal the "
                    "target's (leave drafter.intermediate_size / num_attention_heads / num_key_value_heads / "
                    "head_dim at null) or set drafter.init_from_target=false")
            tensors[mine] = f.get_tensor(key)
    finally:
        for f in handles.values():
            f.__exit__(None, None, None)
    for mine, value in tensors.items():
        own[mine].copy_(value.to(dtype=own[mine].dtype, device=own[mine].device))
    log.info("drafter initialised from target layers %s (%d tensors)", layer_ids, len(tensors))
    return list(layer_ids)
