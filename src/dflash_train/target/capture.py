"""The frozen target: load any local HF causal LM (multimodal configs resolve to their text model)
and capture the outputs of `target_layer_ids` without running later layers or the lm_head."""

from __future__ import annotations

import functools
import logging
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from safetensors import safe_open
from torch import nn
from torch.distributed.fsdp import FSDPModule
from transformers import AutoConfig, AutoTokenizer, PretrainedConfig, PreTrainedModel

from ..errors import ConfigError, ModelError
from ..accel.fp8 import named_linears
from .hf_config import text_config
from .hf_model import MULTIMODAL_KEY_MAPPING, checkpoint_keys, decoder_of, is_multimodal, model_class
from .quantize import quantize_decoder_layers

log = logging.getLogger(__name__)


def read_target_config(path: str | Path, trust_remote_code: bool = False) -> PretrainedConfig:
    """The target's text config, from config.json alone (no weights): used to validate early."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path}/config.json not found: the target must be a local Hugging Face model folder")
    return text_config(AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code))


def target_skeleton(path: str | Path, trust_remote_code: bool = False) -> nn.Module:
    """The target's module tree on the meta device (no weights, no memory): its parameter names and shapes."""
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    model_cls, build_config = model_class(config)
    with torch.device("meta"):
        if issubclass(model_cls, PreTrainedModel):  # a concrete text-model class
            return model_cls(build_config)
        return model_cls.from_config(build_config, trust_remote_code=trust_remote_code)  # an Auto class


def target_fp8_linears(path: Path, trust_remote_code: bool, count: int) -> list[tuple[str, nn.Module]]:
    """The linears of the target's first `count` decoder layers, from its module tree on the meta device."""
    layers = decoder_of(target_skeleton(path, trust_remote_code)).layers
    return [(f"layers.{i}.{name}", m) for i in range(count) for name, m in named_linears(layers[i])]


def load_target_model(
    path: str | Path, dtype: torch.dtype, device: torch.device, trust_remote_code: bool = False,
    fp8_layers: int = 0,
) -> PreTrainedModel:
    """Load the causal LM of `path`, frozen and in eval mode. A multimodal checkpoint loads its text
    model class (never the vision wrapper), mapping the checkpoint's prefixed weight names. `fp8_layers`
    (`target.quantize=fp8`): the linears of the first that many decoder layers are quantised to FP8 on their
    way to `device` (`quantize.quantize_decoder_layers`); the rest of the model keeps `dtype`."""
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    kwargs: dict = dict(dtype=dtype, trust_remote_code=trust_remote_code)
    model_cls, build_config = model_class(config)
    if build_config is not config:
        log.info("target %s is multimodal (%s); loading its text model %s", path, type(config).__name__, model_cls.__name__)
        model = model_cls.from_pretrained(path, config=build_config, key_mapping=MULTIMODAL_KEY_MAPPING, **kwargs)
    else:
        if is_multimodal(config):  # no text-only class in transformers: capture reads its language model
            log.info("target %s is multimodal (%s) with no text-only class; loading it whole (vision weights unused)",
                     path, type(config).__name__)
        model = model_cls.from_pretrained(path, **kwargs)
    model.eval()
    model.requires_grad_(False)
    if fp8_layers:
        done = quantize_decoder_layers(decoder_of(model).layers, fp8_layers, device)
        log.info("target.quantize=fp8: %d linears of decoder layers 0..%d in FP8 (row-wise scales); the other "
                 "layers, the embedding and the lm_head stay %s", len(done.quantized), fp8_layers - 1, dtype)
    model.to(device)
    return model


class _CaptureDone(Exception):
    """Raised by the hook on the last needed layer: the rest of the forward never runs."""


# `target.compile`: where the decoder layers may be compiled, and how. Inductor on CPU is slow to
# compile and not what we train on, so a CPU target refuses the option. Tests swap in Dynamo's "eager"
# backend (tracing, guards and recompiles without inductor) and allow the CPU.
_COMPILE_DEVICES = ("cuda",)
_COMPILE_BACKEND = "inductor"


def compiled_layer_forward(layer_cls: type) -> Callable:
    """One compiled callable per decoder-layer class, through the compile layer (one process lock,
    fullgraph: a recompile-limit hit raises). It is `layer_cls.forward` itself, so the layer is its first
    argument: every layer of the class shares one graph (parameters are graph inputs, not constants),
    and hooks stay outside the graph because they run in `Module.__call__`. Dynamic batch and sequence
    dimensions; Dynamo still specialises a batch of 1, so a warm-up compiles batch 1 and batch >= 2."""
    from ..accel.compile import compiled

    backend = _COMPILE_BACKEND
    name = f"target_layer[{backend}]:{layer_cls.__module__}.{layer_cls.__qualname__}"
    return compiled(name, layer_cls.forward, dynamic=True, backend=backend)


def _warm_up_lengths(near: int, avoid: set[int]) -> tuple[int, int, int]:
    """Three sequence lengths from `near` up for the warm-up and its check: primes that equal no input
    dimension of a layer (batch, hidden size, head dim). Dynamo gives equal sizes one symbol ("duck
    sizing"): a warm-up length equal to the hidden size would tie the sequence length to it, and every
    other length would then recompile."""
    found: list[int] = []
    n = max(int(near), 5)
    while len(found) < 3:
        if n not in avoid and all(n % d for d in range(2, int(n**0.5) + 1)):
            found.append(n)
        n += 1
    return found[0], found[1], found[2]


@dataclass
class TargetCapture:
    """A target read up to its last needed layer; `__call__` returns `[B, S, K*H]`. The model stays
    whole (speculative decoding during training uses it), but a capture stops the forward right after
    the last captured layer: later layers, the final norm and the lm_head never run. `capture(...,
    with_final=True)` runs them all but the lm_head (distillation needs what feeds the lm_head).

    `compile=True` (`target.compile`) runs the decoder layers through one compiled forward per layer
    class (RMSNorm, rotary, SiLU*mul, residual adds and casts fused around the matmuls). The compiled
    forwards are put on the layers for the duration of a capture only: speculative decoding (KV cache)
    keeps the model's own eager forward. Call `warm_up()` before training so that no step compiles."""

    model: PreTrainedModel
    layer_ids: list[int]
    embed_tokens: nn.Module
    lm_head: nn.Linear
    num_layers: int
    hidden_size: int
    compile: bool = False
    _forwards: list = field(default_factory=list, repr=False)  # per layer: its compiled forward, bound
    # The decoder is an FSDP2 root (`target.sharding: fsdp`, target/shard.py): a capture runs a decoder cut
    # after the last captured layer instead of stopping it by an exception (every FSDP post-forward must run).
    sharded: bool = False
    # Tensor-parallel layers (`target.sharding: tp`, target/tensor_parallel.py): their shard group, whose members
    # each bring their own batch; a capture runs every member's batch in turn and keeps this rank's.
    tp_group: Any = None

    @classmethod
    def from_model(cls, model: PreTrainedModel, layer_ids: list[int], compile: bool = False) -> "TargetCapture":
        tc = text_config(model.config)
        decoder = decoder_of(model)
        num_layers = len(decoder.layers)
        if max(layer_ids) >= num_layers:
            raise ConfigError(f"config key 'drafter.target_layer_ids': {layer_ids} exceed the target's {num_layers} layers "
                              f"(ids run from 0 to {num_layers - 1})")
        forwards = []
        if compile:
            device = model.get_input_embeddings().weight.device
            if device.type not in _COMPILE_DEVICES:
                raise ConfigError(
                    f"config key 'target.compile': compiles the target's decoder layers with inductor for CUDA "
                    f"GPUs, but the target is on {device.type} (run.device=cpu, or auto without a GPU); set "
                    f"target.compile=false"
                )
            by_class: dict[type, Callable] = {}
            for i, layer in enumerate(decoder.layers):
                if "forward" in vars(layer):
                    raise ConfigError(
                        f"config key 'target.compile': decoder layer {i} ({type(layer).__name__}) already has its own forward "
                        "(e.g. accelerate hooks from a device_map load); load the target on one device without "
                        "hooks, or set target.compile=false"
                    )
                if type(layer) not in by_class:
                    by_class[type(layer)] = compiled_layer_forward(type(layer))
                forwards.append(functools.partial(by_class[type(layer)], layer))
        sharded = isinstance(decoder, FSDPModule)
        if sharded:
            from .shard import prepare_capture

            prepare_capture(decoder, max(layer_ids))
        from .tensor_parallel import shard_group_of

        return cls(model, list(layer_ids), model.get_input_embeddings(), model.get_output_embeddings(),
                   num_layers, tc.hidden_size, compile, forwards, sharded, shard_group_of(decoder))

    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.capture(input_ids)[0]

    @torch.no_grad()
    def capture(self, input_ids: torch.Tensor, with_final: bool = False) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Right-padded `input_ids [B, S]` -> (`[B, S, K*H]` captured layers, the final normed hidden state
        `[B, S, H]` when `with_final`, else None). Causal attention means padding never reaches a real
        token, so no attention mask is passed (the fast causal kernels stay usable)."""
        if self.tp_group is None:
            return self._capture(input_ids, with_final)
        from .tensor_parallel import members_inputs

        batches, me = members_inputs(input_ids, self.tp_group)
        mine = None
        for i, ids in enumerate(batches):  # in the same order on every member: the all-reduces pair up
            out = self._capture(ids, with_final)
            mine = out if i == me else mine
        return mine

    def _capture(self, input_ids: torch.Tensor, with_final: bool) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        captured: dict[int, torch.Tensor] = {}
        decoder = decoder_of(self.model)
        stop_at = None if with_final else max(self.layer_ids)
        layers = decoder.layers
        if self.sharded and stop_at is not None:
            decoder.layers, stop_at = layers[: stop_at + 1], None  # the cut decoder ends at the last captured layer
        hooks = []
        for lid in self.layer_ids:
            def hook(_m, _inp, out, lid=lid):
                captured[lid] = out[0] if isinstance(out, tuple) else out
                if lid == stop_at:
                    raise _CaptureDone
            hooks.append(decoder.layers[lid].register_forward_hook(hook))
        final = None
        try:
            for layer, fwd in zip(decoder.layers, self._forwards):  # compiled: an instance forward, hooks outside
                layer.forward = fwd
            out = decoder(input_ids=input_ids, use_cache=False)
            if with_final:  # HF decoders apply their final norm to last_hidden_state
                final = out[0] if isinstance(out, tuple) else out.last_hidden_state
        except _CaptureDone:
            pass
        finally:
            decoder.layers = layers
            for h in hooks:
                h.remove()
            for layer in decoder.layers[: len(self._forwards)]:
                vars(layer).pop("forward", None)
        return torch.cat([captured[lid] for lid in self.layer_ids], dim=-1), final

    def warm_up(self, length: int = 257, one_row: bool = True, several_rows: bool = True,
                with_final: bool = True) -> dict:
        """Compile what captures will run (no-op unless `compile`): no grad, the weights' dtype and device,
        batch >= 2 and batch 1 (Dynamo specialises size 1; `one_row` / `several_rows`: the kinds the data has),
        the layers the captures run: every layer with `with_final` (a run that reads the target's final hidden
        states, `architectures.reads_target_final`), else those up to the last captured layer, as a capture
        stops there. The layers share one compiled forward, so running layers that no capture runs can only
        add graphs: a target quantised to FP8 up to its last captured layer (`train.fp8_plan.fp8_target_layers`)
        would compile its bf16 layers too, on a failed guard on their linears' type. At lengths from
        `length` up (pass a production length: inductor picks kernel configs from the first sizes it sees)
        that tie no symbol to a model dimension. Then a capture of a third length and batch must reuse the
        graphs (a new compile there is logged as a warning and counted in `target_recompiled_after_warmup`).
        Under the compile layer's lock. Returns timings and graph counts for the run's status."""
        if not self.compile:
            return {}
        from ..accel.compile import graphs_compiled, lock

        tc = text_config(self.model.config)
        head_dim = getattr(tc, "head_dim", None) or self.hidden_size // tc.num_attention_heads
        s0, s1, s2 = _warm_up_lengths(length, {self.hidden_size, head_dim, 2, 3})
        device = self.embed_tokens.weight.device
        vocab = self.embed_tokens.weight.shape[0]
        g = torch.Generator(device="cpu").manual_seed(0)

        def ids(b: int, s: int) -> torch.Tensor:
            return torch.randint(0, vocab, (b, s), generator=g).to(device)

        t0 = time.time()
        with lock():
            graphs = graphs_compiled()
            for b, s in ((2, s0),) * several_rows + ((1, s1),) * one_row:
                self.capture(ids(b, s), with_final=with_final)
            compiled_graphs = graphs_compiled() - graphs
            self.capture(ids(3 if several_rows else 1, s2), with_final=with_final)
            again = graphs_compiled() - graphs - compiled_graphs
            if device.type == "cuda":
                torch.cuda.current_stream(device).synchronize()
        if again:
            log.warning("target.compile: a capture of a new batch size and length compiled %d more graph(s) after "
                        "the warm-up; training steps may compile too (see the recompile reasons in the log)", again)
        info = {"target_compile_s": round(time.time() - t0, 2), "target_compiled_graphs": int(compiled_graphs),
                "target_recompiled_after_warmup": int(again)}
        log.info("target.compile: %d graph(s) for %d decoder layers in %.1f s", compiled_graphs, len(self._forwards),
                 info["target_compile_s"])
        return info


def load_tokenizer(path: str | Path, trust_remote_code: bool = False):
    tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


MASK_NAMES = ("<|MASK|>", "<mask>", "<|mask|>", "[MASK]")
_RESERVED = re.compile(r"reserved|unused", re.IGNORECASE)  # Llama 3's <|reserved_special_token_N|>, Gemma's <unusedN>


def default_mask_token_id(tokenizer, suggestion: Optional[int] = None, embedding_rows: Optional[int] = None) -> int:
    """The mask token of `drafter.mask_token_id: null`: one the model never emits in normal text. In order: the
    target folder's documented choice; a mask token of the vocabulary; the first embedding row past every token id
    (`embedding_rows`: the target's vocab_size), which no text encodes to (Qwen3's 151669, the reference drafters'
    choice); a reserved special token. Never pad, eos or bos. None of them: a ConfigError that says what to set."""
    if suggestion is not None:
        return int(suggestion)
    vocab = tokenizer.get_vocab()
    for name in MASK_NAMES:
        if name in vocab:
            return int(vocab[name])
    past = max(vocab.values()) + 1
    if embedding_rows is not None and embedding_rows > past:
        log.info("drafter.mask_token_id: %d, the first of the target's %d embedding rows past its tokenizer's ids",
                 past, embedding_rows - past)
        return past
    taken = {tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.bos_token_id}
    specials = sorted((i, t) for t, i in tokenizer.get_added_vocab().items()
                      if i not in taken and (embedding_rows is None or i < embedding_rows))
    reserved = [(i, t) for i, t in specials if _RESERVED.search(t)]
    if reserved:
        log.info("drafter.mask_token_id: %d (%s, a reserved token of the tokenizer)", *reserved[0])
        return int(reserved[0][0])
    shown = ", ".join(f"{t} ({i})" for i, t in specials[:20]) + (f" and {len(specials) - 20} more"
                                                                   if len(specials) > 20 else "")
    raise ConfigError(
        f"drafter.mask_token_id is null, but the target's tokenizer has no mask token ({', '.join(MASK_NAMES)}), no "
        "reserved token and no embedding row past its tokens to take by default: set drafter.mask_token_id=ID (an "
        "override, or in the config) to the id of a special token the model never emits in normal text (not pad or "
        "eos)" + (f"; its special tokens: {shown}" if shown else ""))


@dataclass
class TargetHead:
    """What a drafter rank of a split placement needs from the target: the input embedding (block
    tokens) and the lm_head (the loss). The decoder layers live on the target ranks only."""

    embed_tokens: nn.Embedding
    lm_head: nn.Linear


def _find_key(keys: dict[str, Path], name: str) -> Optional[str]:
    """The checkpoint key of the parameter `name` (e.g. model.embed_tokens.weight); multimodal
    checkpoints prefix the text model's names, so match on the module's own name when needed."""
    if name in keys:
        return name
    suffix = ".".join(name.split(".")[-2:])
    found = [k for k in keys if k == suffix or k.endswith("." + suffix)]
    if len(found) > 1:
        found = [k for k in found if "language_model" in k] or found
    return found[0] if len(found) == 1 else None


def load_target_head(path: str | Path, dtype: torch.dtype, device: torch.device,
                     trust_remote_code: bool = False) -> TargetHead:
    """The target's embedding and lm_head alone, read from its safetensors: a 27B target's decoder
    never touches a drafter rank's memory."""
    path = Path(path)
    tc = text_config(AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code))
    skeleton = target_skeleton(path, trust_remote_code)  # the module tree names the two tensors
    embed_param, head_param = skeleton.get_input_embeddings().weight, skeleton.get_output_embeddings().weight
    named = list(skeleton.named_parameters(remove_duplicate=False))
    embed_name = next(n for n, p in named if p is embed_param and "embed" in n)
    head_name = next((n for n, p in named if p is head_param and "embed" not in n), embed_name)
    keys = checkpoint_keys(path)

    def read(name: str) -> Optional[torch.Tensor]:
        key = _find_key(keys, name)
        if key is None:
            return None
        with safe_open(keys[key], framework="pt") as f:
            return f.get_tensor(key).to(device=device, dtype=dtype)

    embed = read(embed_name)
    if embed is None:
        raise ModelError(f"the target's input embedding ({embed_name}) is not in {path}'s safetensors")
    head = read(head_name) if head_name != embed_name else None
    if head is None:
        if not getattr(tc, "tie_word_embeddings", False):
            raise ModelError(f"the target's lm_head ({head_name}) is not in {path}'s safetensors and its config does "
                           "not tie it to the embedding")
        head = embed
    embed_tokens = nn.Embedding(embed.shape[0], embed.shape[1], device="meta")
    embed_tokens.weight = nn.Parameter(embed, requires_grad=False)
    lm_head = nn.Linear(head.shape[1], head.shape[0], bias=False, device="meta")
    lm_head.weight = nn.Parameter(head, requires_grad=False)
    return TargetHead(embed_tokens, lm_head)
