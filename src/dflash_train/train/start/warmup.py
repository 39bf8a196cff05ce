"""The warm-up before the first step: everything the loop will run compiles here, on the plan's own batches,
then the compile layer is sealed (a later compile counts as a recompile)."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Optional, Sequence

import torch

from ...data.batch import Batch, collate
from ...accel import compile as compile_layer
from ...architectures import reads_target_final
from ...target.capture import TargetCapture
from ...run.reporter import Reporter
from ..plan import size_classes
from ..loop.train_loop import Session
from .rank_checks import Admitted
from .rank_setup import RankSetup
from ..loop.step import TrainStep
from ..loop.validate import evaluating, validation_batches_to_warm_up, validation_loss

log = logging.getLogger(__name__)


def _other_batch_size(batch: Batch, hidden: Optional[torch.Tensor]) -> tuple[Batch, Optional[torch.Tensor]]:
    """A batch of the other kind than `batch` for the warm-up: Dynamo specialises a size of 1, so batches of
    one row and of several compile separate graphs. One row (trimmed to its length), or the row twice."""
    if batch.input_ids.shape[0] >= 2:
        n = int(batch.lengths[0])
        return (Batch(batch.input_ids[:1, :n], batch.loss_mask[:1, :n], batch.lengths[:1]),
                None if hidden is None else hidden[:1, :n])
    return (Batch(batch.input_ids.repeat(2, 1), batch.loss_mask.repeat(2, 1), batch.lengths.repeat(2)),
            None if hidden is None else hidden.repeat(2, 1, 1))


def batch_kinds(planned: list[list[int]]) -> tuple[bool, bool]:
    """(one-row batches, batches of several rows) in an epoch's plan: Dynamo compiles the two apart, so a
    warm-up compiles what the data has (one kind costs half the compile time)."""
    rows = {len(b) for b in planned}
    return min(rows) == 1, max(rows) > 1


def warm_up(train_step: TrainStep, batch, cache_dir: Path, validation: Sequence[tuple[int, Batch]] = (),
            hidden: Optional[torch.Tensor] = None, kinds: tuple[bool, bool] = (True, True),
            extremes: tuple = ()) -> dict:
    """Compile everything the loop will run, exactly as the loop runs it (grad on, forward + backward,
    production dtype, dynamic shapes, the batch kinds of `batch_kinds`), then seal the compile layer.
    `extremes`: the plan's batches at the edges of its sizes (`size_classes.warm_up_batches`), run after the
    first so that any variant they need compiles here (the number that did is reported: 0 means the first
    batch's graphs serve the whole plan). `validation`: (index, batch) of the validation batches at the edges
    of validation's sizes (`validate.validation_batches_to_warm_up`), run as validation runs them (no grad,
    eval mode, their own anchors: `validate.validation_loss`). From the start an eager flex_attention call
    raises. Weights do not change. `cache_dir`: where `compile.configure_cache` pointed inductor (reported)."""
    t0 = time.time()
    compile_layer.begin_warm_up()
    # target.compile: the target's layers first, batch 1 and >= 2, lengths near the first batch's (no-op when off)
    target_info = (train_step.target.warm_up(batch.input_ids.shape[1], *kinds,
                                             with_final=reads_target_final(train_step.cfg, train_step.arch))
                   if isinstance(train_step.target, TargetCapture) else {})
    graphs = compile_layer.graphs_compiled()
    batches = [(batch, hidden), _other_batch_size(batch, hidden)] if all(kinds) else [(batch, hidden)]
    if hidden is not None:  # a split drafter rank: stand-in captures of the shapes a target rank sends
        extremes = [(e, torch.randn(*e.input_ids.shape, hidden.shape[-1], dtype=hidden.dtype, device=hidden.device))
                    for e in extremes]
    else:
        extremes = [(e, None) for e in extremes]
    first_graphs = None
    for n, (b, h) in enumerate(batches + extremes):
        if n == len(batches):
            first_graphs = compile_layer.graphs_compiled()
        stats = train_step.objective(b, torch.Generator().manual_seed(0), hidden=h)
        stats.loss.backward()
        train_step.optimizer.zero_grad(set_to_none=True)
    training_graphs = compile_layer.graphs_compiled()
    with evaluating(train_step.drafter):
        for index, b in validation:
            validation_loss(train_step, b, index)
    if batch.input_ids.is_cuda:
        torch.cuda.current_stream().synchronize()  # not the NCCL stream: it may hold posted receives
    compile_layer.seal()
    info = {"warmup_s": round(time.time() - t0, 2), "compile_cache_dir": str(cache_dir), **compile_layer.cache_stats(),
            "drafter_compiled_graphs": compile_layer.graphs_compiled() - graphs, **target_info}
    if extremes:
        info["warmup_extreme_batches"] = len(extremes)
        info["extreme_batches_compiled_graphs"] = training_graphs - first_graphs
        if info["extreme_batches_compiled_graphs"]:
            log.warning("warm-up: the plan's extreme batches compiled %d graph(s) the first batch's did not (a size "
                        "threshold in the compiled code; the recompile lines above name the guard); compiled now, "
                        "not mid-run", info["extreme_batches_compiled_graphs"])
    if validation:
        info["warmup_validation_batches"] = len(validation)
        info["validation_compiled_graphs"] = compile_layer.graphs_compiled() - training_graphs
    log.info("warm-up done in %.1f s (compile cache %s: %d hits, %d misses)", info["warmup_s"], cache_dir,
             info["fxgraph_cache_hit"], info["fxgraph_cache_miss"])
    return info


def warm_up_drafter_rank(s: Session, a: Admitted, r: RankSetup, rep: Reporter) -> dict:
    """The warm-up on the plan's own batches: its first, and the extremes of its sizes over every epoch the
    run reaches (split drafter ranks compile on stand-in captures of the right shape)."""
    rep.report(phase="warmup")
    first = collate([s.data.example(i) for i in r.epoch0[0]], s.pad_id).to(s.device)
    synthetic = None
    if a.layout is not None:  # the compile needs the shapes and dtype of a capture, not its values
        synthetic = torch.randn(*first.input_ids.shape, len(a.plan.layer_ids) * a.provenance["hidden_size"],
                                dtype=a.plan.target_dtype, device=s.device)
    cfg = s.cfg
    edges_of_plan = size_classes.extreme_classes(
        s.lengths, cfg.data.token_budget, cfg.data.max_batch_size, cfg.run.seed, r.epochs_left(),
        s.train_step.drafter.block_size, cfg.objective.max_anchors, cfg.objective.max_anchors_per_batch,
        s.train_step.backend.blocks_multiple_of)
    log.info("size classes of the plan: %s", size_classes.describe(edges_of_plan))
    extremes = []
    for rows, edges in size_classes.warm_up_batches(edges_of_plan, skip=tuple(r.epoch0[0])):
        extremes.append(collate([s.data.example(i) for i in rows], s.pad_id).to(s.device))
        log.info("warm-up batch: %d rows x %d tokens (%s)", len(rows), extremes[-1].input_ids.shape[1],
                 ", ".join(edges))
    validation = []
    if s.val is not None:  # rank 0: validation's own sizes, in its own mode (validate.py)
        for index, rows, edges in validation_batches_to_warm_up(s.train_step, s.val):
            validation.append((index, collate([s.val.example(i) for i in rows], s.pad_id).to(s.device)))
            log.info("warm-up validation batch %d: %d rows x %d tokens (%s)", index, len(rows),
                     validation[-1][1].input_ids.shape[1], ", ".join(edges))
    return warm_up(s.train_step, first, r.compile_cache, validation, hidden=synthetic, kinds=batch_kinds(r.epoch0),
                   extremes=tuple(extremes))
