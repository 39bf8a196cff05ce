"""The typed config tree: YAML in, dotted `key=value` overrides, validation before any model loads.

Every key lives in one dataclass below; `load_config` is the only way a run gets its config.
Unknown keys and wrong types raise `ConfigError` naming the key and listing the valid ones.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import re
import reprlib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional, Union, get_args, get_origin

import yaml

from . import architectures
from .errors import ConfigError
from .numbers import (ALL_IF_ZERO, BLOCK_SIZE, FRACTION, INDEX, NON_NEGATIVE_NUMBER, POSITIVE_INT, POSITIVE_NUMBER,
                      TRAINING_SEED, Rule)
from .runtime import write_text_atomic
from .trackers import TRACKERS, tracker_unavailable

log = logging.getLogger(__name__)
_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother, _REPR.maxlist, _REPR.maxdict = 3, 80, 80, 8, 8
_INT_LIMIT = 2**63  # ints are counts, ids and seeds: beyond int64 nothing downstream can use them
# YAML 1.1 (PyYAML) reads `1e-4` (no dot) as a string; a float key accepts it as the number it means.
_EXPONENT_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


def _quoted(text: str, limit: int = 120) -> str:
    """A user's own text (an override) in quotes, as typed, cut to `limit` characters."""
    return f"'{text}'" if len(text) <= limit else f"'{text[: limit - 20]}...{text[-10:]}' ({len(text)} characters)"


def _show(value: Any) -> str:
    """A short repr for messages: bounded for huge, deep or self-referencing values."""
    try:
        return _REPR.repr(value)
    except (ValueError, RecursionError):  # e.g. an int beyond Python's 4300-digit str limit
        return f"<{type(value).__name__}>"


@dataclass
class TargetConfig:
    # "smollm2" (embedded default), a local HF folder, or a .gguf file.
    path: str = "smollm2"
    # Weights dtype of the frozen target: auto = bfloat16 on GPU, float32 on CPU.
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    # Let transformers run Python code shipped in the target's folder (custom model classes). Only for folders
    # you trust.
    trust_remote_code: bool = False
    # Compile the target's decoder layers (torch.compile/inductor, one graph per layer class, dynamic
    # batch and length, compiled in the warm-up): fuses the memory-bound pieces around the matmuls.
    # CUDA only: a CPU device refuses it.
    compile: bool = False
    # none: every rank holds the whole target. fsdp: the ranks of a shard group each hold a slice of every
    # decoder layer (FSDP2) and read only that slice from the checkpoint; a capture all-gathers one layer at a
    # time. tp: tensor parallel, each rank holds its heads and MLP columns of every layer and all-reduces
    # activations twice per layer (dense targets; heads and MLP width must divide by the group). For targets
    # that do not fit one GPU (colocated or split placement).
    sharding: str = "none"
    # fsdp, tp: how many ranks share one copy of the target (consecutive target ranks; it must divide them: all ranks
    # colocated, parallel.target_ranks split). Several groups each hold the whole target (HSDP). null = one group.
    shard_group_size: Optional[int] = None
    # fp8: the linears of the decoder layers the capture runs (up to the last captured one; all of them with
    # distillation) quantised once at load to float8 e4m3 with one scale per output channel, each token's
    # activations quantised on the fly; torch._scaled_mm matmuls. For a target served in FP8: the drafter then
    # learns the hidden states the served target computes. The embedding and lm_head stay in target.dtype.
    quantize: Literal["none", "fp8"] = "none"


@dataclass
class DrafterConfig:
    # The drafter architecture (`algorithms/`; docs/architectures/): dflash, the reference block drafter, or another
    # registered one. An architecture's own keys sit in a section named after it (`NAME.key`; the sections after
    # `parallel` on this page), accepted only when drafter.architecture names it.
    architecture: str = "dflash"
    # Decoder layers of the drafter.
    num_draft_layers: int = 5
    # Tokens per block: the anchor (a known token) and block_size - 1 masked slots the drafter fills in one
    # pass; a served drafter proposes block_size - 1 tokens per step.
    block_size: int = 16
    # Outputs of these target decoder layers feed the drafter; null = the reference rule.
    target_layer_ids: Optional[list[int]] = None
    # A token the tokenizer never emits in normal text; null = the target's documented default.
    mask_token_id: Optional[int] = None
    # flex: compiled block-sparse (GPU). sdpa: dense boolean mask (CPU, small inputs).
    attention_backend: Literal["auto", "flex", "sdpa"] = "auto"
    # Layer shape; null = the target's. The hidden size is always the target's. A narrower drafter
    # (fewer heads, smaller MLP) trains more target tokens per GPU-second.
    intermediate_size: Optional[int] = None
    # Attention heads of a drafter layer; null = the target's.
    num_attention_heads: Optional[int] = None
    # Key/value heads (grouped-query attention); null = the target's. Must divide num_attention_heads.
    num_key_value_heads: Optional[int] = None
    # Width of one attention head; null = the target's.
    head_dim: Optional[int] = None
    # Start the drafter's decoder layers as copies of the target's last num_draft_layers decoder
    # layers (and its final norm as the target's), read from the target's safetensors; fc stays
    # random. Needs the target's layer shape (the four keys above at null).
    init_from_target: bool = False
    # Compile the drafter's layers for training (torch.compile/inductor, two graphs shared by all layers,
    # dynamic batch and length, compiled in the warm-up): fuses the norms, RoPE, SiLU x mul and residual
    # adds around the matmuls. CUDA only: a CPU device refuses it.
    compile: bool = False
    # Sliding-window attention in every drafter layer (null = full attention): a block slot at position p
    # sees the context positions p - sliding_window + 1 .. anchor - 1 (so slot i sees sliding_window - 1 - i
    # of them), as the reference decoder does. Must exceed block_size (else the last slots see no context).
    # Exported as top-level layer_types (all sliding_attention), sliding_window and use_sliding_window.
    sliding_window: Optional[int] = None
    # Causal attention inside the block (slot i sees slots 0..i) instead of DFlash's bidirectional block.
    # Exported as an explicit top-level is_causal (true or false): a reader's default when it is absent
    # is causal for sliding layers, so the file never leaves it to that default. Published DFlash2 drafters
    # (sliding, window 2048) set is_causal false, as this default does.
    causal: bool = False
    # Draft logits = lm_head(h) * output_multiplier, then final_logit_softcapping * tanh(x / cap) when the cap is
    # set (null = off). The training loss, decoding and the export (dflash_config) all apply them. vLLM's DFlash
    # (v1) loader does not read them (its DFlash2 one does): keep the defaults for drafters served there.
    output_multiplier: float = 1.0
    # The cap of the draft logits' tanh softcapping (see output_multiplier); null = off.
    final_logit_softcapping: Optional[float] = None
    # drafter.architecture dflash only. 0 = the target's vocabulary through the target's frozen lm_head. N > 0:
    # the drafter scores only the N most frequent label tokens of the training data (counted by `prepare`) with
    # its own trainable lm_head [N, hidden], initialised from the target's rows of those tokens; exported with
    # `draft_vocab_size` and the `d2t` offsets vLLM reads. Labels outside it count as misses.
    draft_vocab_size: int = 0
    # Train the drafter's attention and MLP projections and fc with FP8 matmuls (e4m3, row-wise power-of-two
    # scales, forward and both gradients, as torchao's "rowwise" recipe); master weights stay float32, the
    # lm_head, norms and attention stay in run.dtype. Needs an FP8 GPU (compute capability 8.9+) or the CPU.
    fp8: bool = False
    # With drafter.fp8: how the weight-gradient matmul runs (the forward and the input gradient are row-wise FP8
    # in every case). tensorwise: FP8, one scale per operand (the largest row-wise one; a plain transposed cast);
    # rowwise: FP8, scales per output/input channel along the tokens (a reduction over all tokens fused with a
    # transposed cast, twice per linear); bf16: the compute dtype (no transposed cast, bf16 matmul speed).
    # tensorwise is the default: the fastest (1.43x bf16 per layer against rowwise's 1.31x at the 8B shape) at
    # rowwise's tau (docs/results/quality.md).
    fp8_grad_weight: Literal["rowwise", "tensorwise", "bf16"] = "tensorwise"


@dataclass
class DataConfig:
    # Conversations in OpenAI `messages` JSONL (optionally .gz).
    train_files: list[str] = field(default_factory=list)
    # Tokens per conversation: longer ones are truncated (and far longer ones rejected as bad rows).
    max_length: int = 3072
    # Use at most this many conversations (0 = all).
    max_samples: int = 0
    # A micro-batch holds at most max_batch_size sequences and token_budget tokens (padding included).
    token_budget: int = 16384
    # See token_budget: the most sequences one micro-batch holds.
    max_batch_size: int = 16
    # Validation conversations (raw files); prepared datasets bring their own val split.
    val_files: list[str] = field(default_factory=list)
    # A raw data file that is damaged (cut short, bad compression, empty): true uses its rows before the damage
    # and logs where it was cut; false (the default) refuses the start, naming the file.
    skip_damaged_files: bool = False


@dataclass
class ObjectiveConfig:
    # Anchors sampled per sequence and step.
    max_anchors: int = 512
    # Cap on the blocks one micro-batch computes (rows x blocks per row, not-kept padding included), so
    # the drafter's cost per micro-batch is bounded whatever the batch holds: each row then samples at most
    # cap // rows anchors (rounded down to whole flex tiles, at least one tile). 0 = no cap.
    max_anchors_per_batch: int = 0
    # Loss weight of block slot k is exp(-(k - 1) / gamma).
    gamma: float = 7.0
    # Rows of the lm_head + cross-entropy computed at once (full logits never exist).
    loss_chunk_size: int = 2048
    # How a trained head (drafter.draft_vocab_size > 0) gets its weight gradient. keep: the forward keeps its
    # gradient rows for it ([rows, draft_vocab_size] in run.dtype, counted by the preflight): one matmul in the
    # backward (25 ms of a 0.50 s 8B step, docs/results/performance.md). recompute: the backward forms every chunk's
    # logits again (no [rows, draft_vocab_size] tensor: for a plan short of memory). auto: keep when the head is
    # trained; the target's frozen head has no weight gradient, so nothing with the full vocabulary.
    head_gradient: Literal["auto", "recompute", "keep"] = "auto"
    # gamma: slot k weighs exp(-(k - 1) / gamma). acceptance: slot k weighs the drafter's own (detached)
    # probability of reaching it, prod_{1 <= j < k} p(label_j), floored at acceptance_floor.
    # The default since it won at equal steps: tau 1.559 against 1.363 for gamma (docs/results/quality.md).
    # dpace (arXiv 2605.18810): slot j weighs sum_{m >= j} prod_{i <= m} ((1 - dpace_alpha) p(label_i) + dpace_alpha)
    # over the block's counted slots (blocks.dpace_weights).
    slot_weighting: Literal["gamma", "acceptance", "dpace"] = "acceptance"
    # slot_weighting acceptance: the least weight a slot gets (a slot the drafter rarely reaches still learns).
    acceptance_floor: float = 0.05
    # slot_weighting dpace: the share of each factor that does not depend on the drafter's probability.
    dpace_alpha: float = 0.5
    # Share alpha of the target's softmax(logits / distill_temperature) mixed into the one-hot label.
    distill_weight: float = 0.0
    # The temperature of the target's softmax that distill_weight mixes in.
    distill_temperature: float = 1.0


@dataclass
class OptimConfig:
    # Peak learning rate of the drafter's AdamW.
    lr: float = 6e-4
    # AdamW's decoupled weight decay.
    weight_decay: float = 0.0
    # AdamW's beta1, beta2.
    betas: tuple[float, float] = (0.9, 0.95)
    # AdamW's epsilon.
    eps: float = 1e-8
    # Share of the steps the learning rate warms up linearly from 0.
    warmup_ratio: float = 0.04
    # The learning rate the schedule ends at, as a share of lr.
    min_lr_ratio: float = 0.0
    # wsd: warmup, constant peak, then the last decay_ratio of the steps decay linearly to min_lr_ratio
    # (the default: it beat cosine at equal steps, docs/results/quality.md). cosine: warmup then cosine to min_lr_ratio.
    schedule: Literal["cosine", "wsd"] = "wsd"
    # schedule wsd: the share of the steps, at the end, over which the learning rate decays.
    decay_ratio: float = 0.2
    # Gradients are clipped to this global norm (0 = no clipping).
    grad_clip: float = 1.0
    # Passes over the training data (fractions allowed); 0 = until max_steps.
    epochs: float = 6.0
    # Stop after this many optimizer steps (0 = run all epochs).
    max_steps: int = 0
    # Micro-batches per drafter rank and optimizer step (gradient accumulation).
    grad_accum: int = 1


@dataclass
class RunConfig:
    # Seeds the data order, the anchors and the drafter's initialisation: the same seed and data train the same.
    seed: int = 0
    # auto = cuda when a GPU is visible, else cpu.
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # Compute dtype of the drafter (master weights stay float32).
    dtype: Literal["auto", "bfloat16", "float32"] = "auto"
    # A metrics record (loss, accuracy, tokens/s, ...) every N steps, to train.log, metrics.jsonl and the trackers.
    log_every: int = 10
    # A checkpoint every N steps (and at the end, and on a stop request).
    save_every: int = 500
    # How many step checkpoints are kept (older ones are removed; checkpoints/best is kept apart).
    keep_last: int = 3
    # Dtype of the exported drafter weights.
    export_dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    # A progress bar on the terminal (the log lines come either way).
    progress_bar: bool = True
    # Persistent inductor cache (null = ~/.cache/dflash-train/inductor); a restart reuses compiled kernels.
    compile_cache_dir: Optional[str] = None
    # Validation every N steps (0 = off): teacher-forced tau estimate on eval_batches held-out
    # micro-batches, and real speculative decoding on eval_prompts held-out prompts. The best
    # checkpoint by validation tau is kept in checkpoints/best.
    eval_every: int = 500
    # See eval_every: held-out micro-batches of the teacher-forced walk.
    eval_batches: int = 4
    # See eval_every: held-out prompts decoded for real (0 = none).
    eval_prompts: int = 2
    # See eval_every: new tokens per decoded prompt.
    eval_max_new_tokens: int = 64
    # Experiment trackers that get every metrics record besides TensorBoard (always written): "wandb"
    # (offline, RUN/wandb) and "mlflow" (RUN/mlruns, or MLFLOW_TRACKING_URI). Each needs its package.
    report_to: list[str] = field(default_factory=list)


@dataclass
class ParallelConfig:
    # colocated: every rank runs the target and the drafter (data parallel). split: the last
    # `target_ranks` ranks only run the target and stream hidden states to the drafter ranks.
    placement: Literal["colocated", "split"] = "colocated"
    # split only: how many of the ranks run the target (the rest train the drafter).
    target_ranks: int = 1


@dataclass
class Config:
    target: TargetConfig = field(default_factory=TargetConfig)
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    data: DataConfig = field(default_factory=DataConfig)
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    run: RunConfig = field(default_factory=RunConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    # Not a YAML key: drafter.architecture's own section (an instance of its `Options.section`, read from the YAML
    # section named after the architecture), or None when it declares none. Only that architecture's code reads it.
    options: Any = field(default=None, metadata={"section": False})

    @property
    def keeps_head_gradient(self) -> bool:
        """objective.head_gradient resolved: the forward keeps the trained head's gradient rows."""
        return self.drafter.draft_vocab_size > 0 and self.objective.head_gradient in ("auto", "keep")


# ---------------------------------------------------------------------------- parsing


def _type_name(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in get_args(tp))
    if origin in (Union, types.UnionType):
        return " | ".join(_type_name(a) for a in get_args(tp))
    if origin is not None:
        return f"{origin.__name__}[{', '.join(_type_name(a) for a in get_args(tp))}]"
    return "null" if tp is type(None) else getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check `value` against the annotation `tp`; return it in canonical form or raise."""
    origin = get_origin(tp)
    bad = ConfigError(f"config key '{key}': expected {_type_name(tp)}, got {_show(value)} ({type(value).__name__})")
    if origin is Literal:
        if value not in get_args(tp):
            raise bad
        return value
    if origin in (Union, types.UnionType):
        args = get_args(tp)
        if value is None:
            if type(None) in args:
                return None
            raise bad
        options = [a for a in args if a is not type(None)]
        if len(options) == 1:  # Optional[X]: X's own, more precise error
            return _coerce(value, options[0], key)
        for arg in options:
            try:
                return _coerce(value, arg, key)
            except ConfigError:
                continue
        raise bad
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise bad
        args = get_args(tp)
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(value) != len(args):
                raise bad
            return tuple(_coerce(v, a, f"{key}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
        elem = args[0] if args else Any
        items = [_coerce(v, elem, f"{key}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if tp is bool:
        if not isinstance(value, bool):
            raise bad
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad
        if not -_INT_LIMIT <= value < _INT_LIMIT:
            raise ConfigError(f"config key '{key}': {_show(value)} is out of range (a 64-bit integer is expected)")
        return value
    if tp is float:
        if isinstance(value, str) and _EXPONENT_FLOAT.fullmatch(value.strip()):
            value = float(value)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad
        try:
            value = float(value)
        except OverflowError:  # an int too large for a float
            value = math.inf
        if not math.isfinite(value):
            raise ConfigError(f"config key '{key}': must be a finite number, got {value}")
        return value
    if tp is str:
        if not isinstance(value, str):
            raise bad
        return value
    if tp is Any:
        return value
    raise ConfigError(f"config key '{key}': unsupported type {tp}")


def _section_fields() -> list[dataclasses.Field]:
    """The fields of `Config` that are YAML sections (all but `options`)."""
    return [f for f in dataclasses.fields(Config) if f.metadata.get("section", True)]


def _build(cls: type, data: Any, prefix: str, also_valid: tuple[str, ...] = ()) -> Any:
    """`cls` from the mapping `data` (`also_valid`: more keys the caller takes out before, listed as valid)."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.metadata.get("section", True)}
    where = prefix.rstrip(".") or "the top level"
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"config section '{where}' must be a mapping, got {type(data).__name__}")
    kwargs = {}
    for name, value in data.items():
        if name not in fields:
            valid = ", ".join(sorted([*fields, *also_valid]))
            raise ConfigError(f"unknown config key '{prefix}{name}'; valid keys in {where}: {valid}")
        tp = hints[name]
        if dataclasses.is_dataclass(tp):
            kwargs[name] = _build(tp, value, f"{prefix}{name}.")
        else:
            kwargs[name] = _coerce(value, tp, f"{prefix}{name}")
    return cls(**kwargs)


def _parse_scalar(text: str) -> Any:
    """A command-line value is read as YAML: `3e-4` -> float, `[1,2]` -> list, `null` -> None."""
    try:
        return yaml.load(text, Loader=_StrictLoader)
    except (yaml.YAMLError, ValueError, RecursionError):  # not YAML, or YAML Python cannot hold: the text
        return text


class _StrictLoader(yaml.SafeLoader):
    """yaml.safe_load that refuses a key given twice in one mapping (PyYAML keeps the last silently, so
    a second `optim:` section would wipe out the first)."""


def _construct_unique_mapping(loader: yaml.SafeLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: dict = {}
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":
            continue
        key = loader.construct_object(key_node, deep=True)
        line = key_node.start_mark.line + 1
        try:
            first = seen.get(key)
        except TypeError:  # unhashable: construct_mapping reports it
            continue
        if first is not None:
            raise ConfigError(f"config key '{key}' is given twice (lines {first} and {line}); "
                              "the second would silently replace the first: merge them")
        seen[key] = line
    return loader.construct_mapping(node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_unique_mapping)


def _apply_override(tree: dict, item: str, renamed: Optional[str] = None) -> None:
    """`renamed`: the dotted key to set instead of the one `item` names (an old key's new name)."""
    if "=" not in item:
        raise ConfigError(f"override {_quoted(item)} must look like section.key=value (e.g. optim.lr=3e-4)")
    dotted, raw = item.split("=", 1)
    parts = (renamed or dotted.strip()).split(".")
    node = tree
    for part in parts[:-1]:
        child = node.get(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {_quoted(item)}: {_quoted(part)} is not a section")
        node[part] = child = dict(child)  # copy on the way down: the caller's dict is never changed
        node = child
    value = _parse_scalar(raw)
    # yaml reads "1e-4" as a string; accept it as a number where a float is meant.
    if isinstance(value, str):
        try:
            value = float(value) if any(c in value for c in ".eE") else value
        except ValueError:
            pass
    node[parts[-1]] = value


# ---------------------------------------------------------------------------- the architectures' sections
# Each registered architecture may declare its own keys (`architectures.Options`, in its package's torch-free
# options.py): a top-level section named after it, built here beside the generic ones, accepted only when
# drafter.architecture names it, and handed to its code as `Config.options`.


def _sections() -> dict[str, architectures.Options]:
    """Architecture name -> its options, for every registered architecture that declares a section."""
    return {name: o for name in architectures.names() if (o := architectures.options(name)).section is not None}


def old_key_names() -> dict[str, str]:
    """Old flat key -> its key now, e.g. `drafter.X` -> `NAME.X` (the architectures' `Options.aliases`)."""
    return {old: f"{name}.{new}" for name, o in _sections().items() for old, new in o.aliases.items()}


_aliases = old_key_names


def _move_aliases(tree: dict, moved: dict[str, str]) -> dict:
    """`tree` with the old flat keys it holds moved into their architecture's section (a copy: sections are copied
    when changed); `moved` gets new key -> old key for each."""
    tree = dict(tree)
    for old, new in _aliases().items():
        section, key = old.split(".")
        body = tree.get(section)
        if not isinstance(body, dict) or key not in body:
            continue
        new_section, new_key = new.split(".")
        target = tree.get(new_section)
        if target is not None and not isinstance(target, dict):
            continue  # the section itself is malformed: _build names it
        if isinstance(target, dict) and new_key in target:
            raise ConfigError(f"config key '{old}' is the old name of '{new}', which is given too: remove '{old}'")
        body = dict(body)
        value = body.pop(key)
        tree[section] = body
        tree[new_section] = {**(target or {}), new_key: value}
        moved[new] = old
    return tree


def _check_section_numbers(name: str, options: architectures.Options, section: Any) -> None:
    hints = _hints(type(section))
    for key, rule in options.number_rules.items():
        _check_number(f"{name}.{key}", rule, getattr(section, key), type(None) in get_args(hints[key]))


def _build_config(tree: dict, final: bool = False, moved: Optional[dict[str, str]] = None) -> Config:
    """The generic sections, and each architecture section present (types and ranges). `final`: also refuse a
    section whose architecture drafter.architecture does not name, and set `options` (the defaults when absent).
    A section made only of old flat keys at their defaults (`moved`), as every config.yaml written before the
    sections holds for each architecture, is dropped instead of refused."""
    sections = _sections()
    cfg = _build(Config, {k: v for k, v in tree.items() if k not in sections}, "", tuple(sections))
    built = {name: _build(o.section, tree[name], f"{name}.") for name, o in sections.items() if name in tree}
    for name, section in built.items():
        _check_section_numbers(name, sections[name], section)
    if not final:
        return cfg
    arch = cfg.drafter.architecture
    for name, section in built.items():
        if name == arch:
            continue
        given = tree[name] or {}
        default = sections[name].section()
        off = [k for k in given if getattr(section, k) != getattr(default, k)]
        if given and not off and all(f"{name}.{k}" in (moved or {}) for k in given):
            continue  # an old config.yaml's flat keys at their defaults: they never applied to this architecture
        key = (off or list(given) or [""])[0]
        dotted = f"{name}.{key}" if key else name
        old = (moved or {}).get(dotted)
        what = sections[name].about or f"the {name} architecture"
        fix = (f"leave {old} at {getattr(default, key)!r} (or remove it)" if old else f"remove the {name} section")
        raise ConfigError(f"config key '{dotted}': applies to {what}; drafter.architecture is {arch!r}: set "
                          f"drafter.architecture={name} or {fix}")
    if arch in sections:
        cfg.options = built.get(arch) or sections[arch].section()
    return cfg


_WARNED: set[tuple[str, ...]] = set()


def _warn_renamed(moved: dict[str, str], cfg: Config, source: Optional[str]) -> None:
    """One warning line per config (per process: a resume reads the run's config.yaml twice) for its old keys."""
    if not moved or tuple(sorted(moved)) in _WARNED:
        return
    _WARNED.add(tuple(sorted(moved)))
    arch = cfg.drafter.architecture
    renamed = ", ".join(f"{old} -> {new}" for new, old in moved.items() if new.startswith(f"{arch}."))
    ignored = ", ".join(old for new, old in moved.items() if not new.startswith(f"{arch}."))
    parts = ([f"read under their new names: {renamed}"] if renamed else []) + (
        [f"ignored (at their defaults; drafter.architecture is {arch!r}): {ignored}"] if ignored else [])
    log.warning("deprecated config keys%s %s; write an architecture's keys in its own section",
                f" in {source}" if source else "", "; ".join(parts))


def _renamed(message: str, moved: dict[str, str]) -> str:
    """A message about a key given under its old name names that name (and the new one)."""
    named = re.search(r"config key '([^']+)'", message)
    if named and named.group(1) in moved:
        new = named.group(1)
        return message.replace(f"config key '{new}'", f"config key '{moved[new]}' (now {new})", 1)
    return message


def config_from_dict(data: dict, overrides: list[str] | None = None, source: str | None = None) -> Config:
    """The config of `data` (a parsed YAML file, `source` names it in messages) with dotted overrides
    applied. An error is blamed on what caused it: the file, the override, or (a cross-field check) the
    override that set the key it names, else the file. Old flat keys of an architecture's section are read
    under their new names (one warning)."""
    if data is not None and not isinstance(data, dict):
        raise ConfigError(f"config section 'the top level' must be a mapping, got {type(data).__name__}")
    suffix = f" ({source})" if source else ""
    moved: dict[str, str] = {}
    try:
        # overrides copy the sections they change; nothing else is ever mutated
        tree = _move_aliases(data or {}, moved)
        _build_config(tree)
    except ConfigError as e:
        raise ConfigError(f"{_renamed(str(e), moved)}{suffix}") from None
    given: dict[str, str] = {}
    aliases = _aliases()
    for item in overrides or []:
        dotted = item.split("=", 1)[0].strip()
        new = aliases.get(dotted)
        try:
            _apply_override(tree, item, new)
            _build_config(tree)
        except ConfigError as e:
            message = _renamed(str(e), {**moved, **({new: dotted} if new else {})})
            named = message if message.startswith("override ") else f"override {_quoted(item)}: {message}"
            raise ConfigError(named) from None
        if new:
            moved[new] = dotted
        elif dotted in moved:  # the file's old key, set again under its new name
            del moved[dotted]
        given[new or dotted] = item
    try:
        cfg = _build_config(tree, final=True, moved=moved)
        validate(cfg)
    except ConfigError as e:
        named = re.match(r"config key '([^']+)'", str(e))
        item = given.get(named.group(1)) if named else None
        message = _renamed(str(e), moved)
        raise ConfigError(f"{message} (override {_quoted(item)})" if item else f"{message}{suffix}") from None
    _warn_renamed(moved, cfg, source)
    return cfg


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> Config:
    data: dict = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file not found: {p}")
        try:
            data = yaml.load(p.read_bytes().decode("utf-8"), Loader=_StrictLoader) or {}
        except UnicodeDecodeError as e:
            raise ConfigError(f"config file {p} is not UTF-8 text (invalid byte at offset {e.start})") from None
        except ConfigError as e:
            raise ConfigError(f"{e} ({p})") from None
        except (yaml.YAMLError, ValueError, RecursionError) as e:  # ValueError: e.g. an int of > 4300 digits
            what = "nested too deeply" if isinstance(e, RecursionError) else str(e)
            raise ConfigError(f"config file {p} is not valid YAML: {what}") from None
        except OSError as e:
            raise ConfigError(f"config file {p} cannot be read: {e.strerror or e}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"config file {p} must hold a mapping of sections, got {type(data).__name__}")
    return config_from_dict(data, overrides, str(path) if path else None)


def config_to_dict(cfg: Config) -> dict:
    """The config as plain YAML data: the generic sections, then drafter.architecture's own (when it has one)."""

    def plain(v: Any) -> Any:
        if isinstance(v, tuple):
            return [plain(x) for x in v]
        if isinstance(v, list):
            return [plain(x) for x in v]
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        return v

    out = {f.name: plain(dataclasses.asdict(getattr(cfg, f.name))) for f in _section_fields()}
    if cfg.options is not None:
        out[cfg.drafter.architecture] = plain(dataclasses.asdict(cfg.options))
    return out


def dump_config(cfg: Config, path: Path) -> None:
    write_text_atomic(path, yaml.safe_dump(config_to_dict(cfg), sort_keys=False))


# ---------------------------------------------------------------------------- validation

_COUNT = Rule(int, low=0)
_BELOW_ONE = Rule(float, low=0, high=1, high_open=True)
# The range of every number in the config (each item of a list; null, where allowed, is not checked here).
NUMBER_RULES: dict[str, Rule] = {
    "target.shard_group_size": POSITIVE_INT,
    "drafter.num_draft_layers": POSITIVE_INT,
    "drafter.block_size": BLOCK_SIZE,
    "drafter.target_layer_ids": INDEX,
    "drafter.mask_token_id": INDEX,
    "drafter.intermediate_size": POSITIVE_INT,
    "drafter.num_attention_heads": POSITIVE_INT,
    "drafter.num_key_value_heads": POSITIVE_INT,
    "drafter.head_dim": POSITIVE_INT,
    "drafter.sliding_window": POSITIVE_INT,
    "drafter.output_multiplier": POSITIVE_NUMBER,
    "drafter.final_logit_softcapping": POSITIVE_NUMBER,
    "drafter.draft_vocab_size": Rule(int, low=0, zero="0 = the target's vocabulary"),
    "data.max_length": POSITIVE_INT,
    "data.max_samples": ALL_IF_ZERO,
    "data.token_budget": POSITIVE_INT,
    "data.max_batch_size": POSITIVE_INT,
    "objective.max_anchors": POSITIVE_INT,
    "objective.max_anchors_per_batch": Rule(int, low=0, zero="0 = no cap"),
    "objective.gamma": POSITIVE_NUMBER,
    "objective.loss_chunk_size": POSITIVE_INT,
    "objective.acceptance_floor": Rule(float, low=0, high=1, low_open=True),
    "objective.dpace_alpha": FRACTION,
    "objective.distill_weight": FRACTION,
    "objective.distill_temperature": POSITIVE_NUMBER,
    "optim.lr": POSITIVE_NUMBER,
    "optim.weight_decay": NON_NEGATIVE_NUMBER,
    "optim.betas": _BELOW_ONE,
    "optim.eps": POSITIVE_NUMBER,
    "optim.warmup_ratio": _BELOW_ONE,
    "optim.min_lr_ratio": FRACTION,
    "optim.decay_ratio": Rule(float, low=0, high=1, low_open=True),
    "optim.grad_clip": Rule(float, low=0, zero="0 = no clipping"),
    "optim.epochs": Rule(float, low=0, zero="0 = until optim.max_steps"),
    "optim.max_steps": Rule(int, low=0, zero="0 = all optim.epochs"),
    "optim.grad_accum": POSITIVE_INT,
    "run.seed": TRAINING_SEED,
    "run.log_every": POSITIVE_INT,
    "run.save_every": POSITIVE_INT,
    "run.keep_last": POSITIVE_INT,
    "run.eval_every": Rule(int, low=0, zero="0 = off"),
    "run.eval_batches": _COUNT,
    "run.eval_prompts": _COUNT,
    "run.eval_max_new_tokens": POSITIVE_INT,
    "parallel.target_ranks": POSITIVE_INT,
}


def number_rules() -> dict[str, Rule]:
    """`NUMBER_RULES` and the ranges of every registered architecture's section (`NAME.key`)."""
    return {**NUMBER_RULES, **{f"{name}.{key}": rule for name, o in _sections().items()
                               for key, rule in o.number_rules.items()}}


def config_sections() -> list[tuple[str, type]]:
    """(name, dataclass) of every YAML section: the generic ones, then each architecture's that declares one."""
    hints = typing.get_type_hints(Config)
    return [(f.name, hints[f.name]) for f in _section_fields()] + [(n, o.section) for n, o in _sections().items()]


def numeric_keys() -> list[str]:
    """Every config key whose value is a number or a list of numbers (optionally null)."""
    keys = []
    for section, section_type in config_sections():
        for name, tp in typing.get_type_hints(section_type).items():
            leaves = {a for a in get_args(tp) if a is not type(None) and a is not Ellipsis} or {tp}
            if any(leaf in (int, float) or set(get_args(leaf)) & {int, float} for leaf in leaves):
                keys.append(f"{section}.{name}")
    return keys


@functools.lru_cache(maxsize=None)
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _check_number(key: str, rule: Rule, value: Any, nullable: bool) -> None:
    items = isinstance(value, (list, tuple))
    for item in value if items else [value]:
        problem = None if item is None else rule.problem(item, or_null=nullable and not items)
        if problem:
            raise ConfigError(f"config key '{key}': {'each item ' if items else ''}{problem}")


def check_numbers(cfg: Config) -> None:
    """Every number of `cfg` inside its `NUMBER_RULES` range (and its architecture section's); the message names
    the key and the range."""
    for key, rule in NUMBER_RULES.items():
        section, name = key.split(".")
        owner = getattr(cfg, section)
        _check_number(key, rule, getattr(owner, name), type(None) in get_args(_hints(type(owner))[name]))
    if cfg.options is not None:
        _check_section_numbers(cfg.drafter.architecture, architectures.options(cfg.drafter.architecture), cfg.options)


def validate(cfg: Config) -> None:
    """Cross-field checks that need no model. Target-dependent checks: `validate_against_target`."""

    def need(ok: bool, key: str, msg: str) -> None:
        if not ok:
            raise ConfigError(f"config key '{key}': {msg}")

    check_numbers(cfg)
    d, o, op, dt, r = cfg.drafter, cfg.objective, cfg.optim, cfg.data, cfg.run
    need(d.architecture in architectures.names(), "drafter.architecture",
         f"must be one of {', '.join(architectures.names())} (got {d.architecture!r})")
    own = architectures.options(d.architecture)
    if own.validate is not None:  # the architecture's own cross-checks (its options.py)
        own.validate(cfg)
    if d.target_layer_ids is not None:
        need(len(d.target_layer_ids) >= 1, "drafter.target_layer_ids", "must list at least one layer (or be null)")
        need(len(set(d.target_layer_ids)) == len(d.target_layer_ids), "drafter.target_layer_ids", "ids must be distinct")
    if d.sliding_window is not None:
        need(d.sliding_window > d.block_size, "drafter.sliding_window",
             f"must be > drafter.block_size = {d.block_size} (or null): block slot i sees the sliding_window - 1 - i "
             f"context positions before its anchor, so a window of {d.sliding_window} leaves the last "
             f"{d.block_size - d.sliding_window + 1} slot(s) no context at all")
    if d.fp8_grad_weight != "tensorwise":
        need(d.fp8, "drafter.fp8_grad_weight",
             f"{d.fp8_grad_weight!r} chooses the FP8 drafter's weight-gradient matmul; set drafter.fp8=true too, "
             "or leave drafter.fp8_grad_weight at its default (tensorwise)")
    if o.head_gradient == "keep":
        need(d.draft_vocab_size > 0, "objective.head_gradient",
             "keep is for a trained head (drafter.draft_vocab_size > 0); the target's frozen head has no weight "
             "gradient: leave objective.head_gradient at auto")
    if d.draft_vocab_size:
        need(d.architecture == "dflash", "drafter.draft_vocab_size",
             f"a reduced draft vocabulary is implemented for drafter.architecture=dflash only; {d.architecture} "
             "scores the target's whole vocabulary: set drafter.draft_vocab_size=0 or drafter.architecture=dflash")
        need(o.distill_weight == 0, "drafter.draft_vocab_size",
             "distillation (objective.distill_weight > 0) mixes in the target's distribution over its whole "
             "vocabulary, which a reduced draft vocabulary cannot express: set objective.distill_weight=0 or "
             "drafter.draft_vocab_size=0")
    if d.num_attention_heads and d.num_key_value_heads:
        need(d.num_attention_heads % d.num_key_value_heads == 0, "drafter.num_key_value_heads",
             f"must divide drafter.num_attention_heads={d.num_attention_heads} (got {d.num_key_value_heads})")
    if op.schedule == "wsd":
        need(op.warmup_ratio + op.decay_ratio <= 1, "optim.decay_ratio",
             f"optim.warmup_ratio + optim.decay_ratio must be <= 1 (got {op.warmup_ratio} + {op.decay_ratio})")
    need(op.epochs > 0 or op.max_steps > 0, "optim.epochs", "set epochs > 0 or optim.max_steps > 0")
    need(dt.max_length >= 2 * d.block_size, "data.max_length",
         f"must be >= 2 * drafter.block_size = {2 * d.block_size} (got {dt.max_length})")
    need(dt.token_budget >= dt.max_length, "data.token_budget",
         f"must be >= data.max_length = {dt.max_length} so that every sequence fits (got {dt.token_budget})")
    for name in r.report_to:
        need(name in TRACKERS, "run.report_to", f"{name!r} is not a tracker; valid: {', '.join(TRACKERS)} "
             "(TensorBoard is always written; [] for it alone)")
    need(len(set(r.report_to)) == len(r.report_to), "run.report_to", f"lists a tracker twice ({r.report_to})")
    if r.device == "cpu":
        validate_compile_device(cfg, "cpu")
    validate_sharding(cfg)
    if cfg.parallel.placement == "split":
        need(r.eval_every == 0, "run.eval_every",
             "validation during training needs the target on the drafter's rank; with parallel.placement=split set "
             "run.eval_every=0 and evaluate checkpoints with `dflash-train eval`")
        need(o.distill_weight == 0, "objective.distill_weight",
             "distillation needs the target's final hidden states, which the split placement does not send to the "
             "drafter ranks yet; use parallel.placement=colocated or set objective.distill_weight=0")


SHARDINGS = ("none", "fsdp", "tp")


def validate_sharding(cfg: Config) -> None:
    """`target.sharding` and `target.shard_group_size`, and what a sharded target does not support yet."""
    t = cfg.target

    def need(ok: bool, key: str, msg: str) -> None:
        if not ok:
            raise ConfigError(f"config key '{key}': {msg}")

    need(t.sharding in SHARDINGS, "target.sharding", f"must be one of {', '.join(SHARDINGS)} (got {t.sharding!r})")
    if t.sharding == "none":
        need(t.shard_group_size is None, "target.shard_group_size",
             "applies to a sharded target only; set target.sharding=fsdp (or tp) or remove target.shard_group_size")
        return
    # DTensor's sharding rules put the batch size modulo the group size into a compiled layer's guards: a
    # batch of another parity would compile again mid-training (measured on CPU with Dynamo's eager backend).
    need(t.sharding != "tp" or not t.compile, "target.compile",
         "a tensor-parallel target's compiled layers would recompile for every new batch-size parity; set "
         "target.compile=false with target.sharding=tp, or use target.sharding=fsdp")
    need(t.quantize == "none", "target.quantize",
         f"an FP8 target cannot be sharded yet (target.sharding={t.sharding}); set target.quantize=none or "
         "target.sharding=none")


def validate_compile_device(cfg: Config, device_type: str) -> None:
    """`target.compile` and `drafter.compile` need a CUDA device (run at config load for run.device=cpu, and
    once `auto` resolves)."""
    for key, on, what in (("target.compile", cfg.target.compile, "the target's decoder layers"),
                          ("drafter.compile", cfg.drafter.compile, "the drafter's layers")):
        if on and device_type != "cuda":
            raise ConfigError(
                f"config key '{key}': compiles {what} with inductor for CUDA GPUs, but the run's device is "
                f"{device_type} (run.device={cfg.run.device}); set {key}=false"
            )


def validate_trackers(cfg: Config) -> None:
    """Each tracker of run.report_to imports here: a missing package fails the start, no silent fallback. Run
    at start-up (by `validate_world`), not by `validate`: a resume loads the run's own config.yaml as it was
    recorded, and must be able to drop a tracker whose package this machine lacks (run.report_to=[])."""
    for name in cfg.run.report_to:
        unavailable = tracker_unavailable(name)
        if unavailable:
            raise ConfigError(unavailable)


def validate_world(cfg: Config, world: int) -> None:
    """Checks at start-up, before any model loads: the number of ranks, and the trackers' packages."""
    validate_trackers(cfg)
    if cfg.parallel.placement == "split" and not 1 <= cfg.parallel.target_ranks < world:
        raise ConfigError(
            f"config key 'parallel.target_ranks': {cfg.parallel.target_ranks} target rank(s) do not fit {world} "
            f"rank(s); the split placement needs at least one target and one drafter rank "
            f"(start more ranks with --nproc, or use parallel.placement=colocated)"
        )
    if cfg.target.sharding != "none":
        validate_shard_groups(cfg, world)


def validate_shard_groups(cfg: Config, world: int) -> None:
    """A sharded target's groups must divide its ranks (all, or the split placement's target ranks); in the split
    placement every target rank captures as many micro-batches per step as its group peers (they all-gather each
    layer together, so they must capture in lockstep)."""
    split = cfg.parallel.placement == "split"
    targets = cfg.parallel.target_ranks if split else world
    what = f"the {targets} target rank(s) (parallel.target_ranks)" if split else f"the run's {world} rank(s)"
    group = cfg.target.shard_group_size
    if group is not None and (group > targets or targets % group):
        raise ConfigError(
            f"config key 'target.shard_group_size': {group} does not divide {what} into shard groups; give a divisor "
            f"of {targets}, or null for one group of all of them"
        )
    per_step = (world - targets) * cfg.optim.grad_accum
    if split and (group or targets) > 1 and per_step % targets:
        raise ConfigError(
            f"config key 'parallel.target_ranks': a sharded target's ranks capture in lockstep, so each step's "
            f"{per_step} micro-batches (drafter ranks x optim.grad_accum) must split evenly over the {targets} target "
            "ranks; change optim.grad_accum or the number of ranks, or set target.shard_group_size=1"
        )


def validate_against_target(cfg: Config, num_target_layers: int, vocab_size: int) -> None:
    """Checks that need only the target's config.json (run before any weights load)."""
    ids = cfg.drafter.target_layer_ids
    if ids is not None and max(ids) >= num_target_layers:
        raise ConfigError(
            f"config key 'drafter.target_layer_ids': {ids} names layer {max(ids)}, but the target has "
            f"{num_target_layers} decoder layers (valid ids 0..{num_target_layers - 1})"
        )
    n = cfg.drafter.draft_vocab_size
    if n > vocab_size:
        raise ConfigError(
            f"config key 'drafter.draft_vocab_size': {n} is larger than the target's vocabulary ({vocab_size} "
            f"tokens); give 1..{vocab_size}, or 0 for the target's whole vocabulary"
        )
    mask = cfg.drafter.mask_token_id
    if mask is not None and mask >= vocab_size:
        raise ConfigError(
            f"config key 'drafter.mask_token_id': {mask} is outside the target's vocabulary (size {vocab_size})"
        )
