"""The config schema: every key of a training config, one dataclass per YAML section, each field with the comment
the configuration reference (docs/guide/config-reference.md) is generated from; and which sections there are (the
generic ones, and the registered architectures' own).
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

from ..architectures import registry


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
    # The drafter architecture (`architectures/`; docs/architectures/): dflash, the reference block drafter, or another
    # registered one. An architecture's own keys sit in a section named after it (`NAME.key`; the sections after
    # `parallel` on this page), accepted only when drafter.architecture names it.
    architecture: str = registry.DEFAULT
    # Decoder layers of the drafter.
    num_draft_layers: int = 5
    # Tokens per block: the anchor (a known token) and block_size - 1 masked slots the drafter fills in one
    # pass; a served drafter proposes block_size - 1 tokens per step.
    block_size: int = 16
    # Outputs of these target decoder layers feed the drafter; null = the reference rule.
    target_layer_ids: Optional[list[int]] = None
    # A token the tokenizer never emits in normal text; null = the target's default: its folder's documented
    # choice, else a mask token of its tokenizer, else its first embedding row past the tokenizer's ids, else a
    # reserved special token (none of them: set it).
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
    # is causal for sliding layers, so the file never leaves it to that default. Published sliding-window
    # drafters of the reference (window 2048) set is_causal false, as this default does.
    causal: bool = False
    # Draft logits = lm_head(h) * output_multiplier, then final_logit_softcapping * tanh(x / cap) when the cap is
    # set (null = off). The training loss, decoding and the export (dflash_config) all apply them. Not every
    # serving loader reads them (vLLM's DFlash v1 loader does not): keep the defaults for drafters served there.
    output_multiplier: float = 1.0
    # The cap of the draft logits' tanh softcapping (see output_multiplier); null = off.
    final_logit_softcapping: Optional[float] = None
    # 0 = the target's vocabulary through the target's frozen lm_head. N > 0: the drafter scores only the N most
    # frequent label tokens of the training data (counted by `prepare`) with its own trainable lm_head [N, hidden],
    # initialised from the target's rows of those tokens; exported with `draft_vocab_size` and the `d2t` offsets
    # vLLM reads. Labels outside it count as misses. Not every architecture implements it: the config check names
    # those that do.
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
class OnPolicyConfig:
    # The finished run this on-policy stage continues (its run directory, whose export/ it reads, or an exported
    # drafter folder); empty: an ordinary training run. Its drafter's weights are the stage's start; the objective
    # becomes Draft-OPD's: at the anchors real speculative decoding visits with the current weights, forward KL on
    # the tokens each step commits and reverse KL on the draft the target rejected (docs/guide/onpolicy.md).
    start_from: str = ""
    # Weight of the committed tokens' term (the accepted drafts and the target's correction).
    committed_weight: float = 1.0
    # Weight of the rejected draft's term.
    rejected_weight: float = 1.0
    # A rejected draft at slot k weighs decay ** (k - 1).
    decay: float = 0.8
    # Log-probabilities are clamped from below to this (the estimators' log(1 - p) and ratios stay finite; a term
    # clamped on the drafter's side carries no gradient). -10: Draft-OPD's official runs'.
    log_prob_min: float = -10.0
    # Each position's loss term is clamped from above to this.
    loss_max: float = 10.0
    # The most decoding steps (blocks) of a row one micro-batch trains on, a random subset of its chain beyond it
    # (0: objective.max_anchors), and at most a row's share of objective.max_anchors_per_batch where that is set, as
    # training's anchors: the step's blocks stay within what training's memory estimate counts.
    max_blocks: int = 0


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
    # The dense bf16 matmul peak (TFLOP/s per GPU) that the metrics' MFU divides by. null: known GPUs' (H200,
    # H100 SXM: 790, measured on an H200); elsewhere (a CPU, another GPU) MFU is null unless this sets it.
    mfu_peak_tflops: Optional[float] = None


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
    onpolicy: OnPolicyConfig = field(default_factory=OnPolicyConfig)
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


def _section_fields() -> list[dataclasses.Field]:
    """The fields of `Config` that are YAML sections (all but `options`)."""
    return [f for f in dataclasses.fields(Config) if f.metadata.get("section", True)]


def _sections() -> dict[str, registry.Options]:
    """Architecture name -> its options, for every registered architecture that declares a section."""
    return {name: o for name in registry.names() if (o := registry.options(name)).section is not None}


def config_sections() -> list[tuple[str, type]]:
    """(name, dataclass) of every YAML section: the generic ones, then each architecture's that declares one."""
    hints = typing.get_type_hints(Config)
    return [(f.name, hints[f.name]) for f in _section_fields()] + [(n, o.section) for n, o in _sections().items()]
