"""A target rank of the split placement: it loads the target (and warms its compiled layers), then serves the
hidden states the drafter ranks ask for, step by step, until they stop."""

from __future__ import annotations

import logging
import time
from typing import Optional

import torch

from ...config.schema import Config
from ...data.batch import collate
from ...accel import compile as compile_layer
from ...architectures import reads_target_final
from ...target.capture import TargetCapture
from ...run.reporter import Reporter
from ..loop.train_loop import memory_gib, micro_batch_groups
from ..start.rank_checks import Admitted
from ..start.rank_setup import RankSetup
from ..loop.stop import StopRequest
from ..start.target_load import load_target
from .transport import SplitLayout, TargetOutbox
from ..start.warmup import batch_kinds

log = logging.getLogger(__name__)


def run_target_server(cfg: Config, a: Admitted, r: RankSetup, rep: Reporter, stop: StopRequest) -> None:
    """A split placement's target rank: load and (optionally) compile the target, then serve every step."""
    target = TargetCapture.from_model(load_target(cfg, a.plan, r, rep), a.plan.layer_ids, compile=cfg.target.compile)
    if target.compile:  # this rank's only compiled code: warm it before serving any step
        rep.report(phase="warmup")
        target.warm_up(cfg.data.max_length, *batch_kinds(r.epoch0), with_final=reads_target_final(cfg, a.arch))
    compile_layer.seal()  # from here a compile counts as a recompile after the warm-up, with its guard
    groups = (g for _, _, _, g in micro_batch_groups(r.batching, r.per_step, r.state.epoch, r.state.batch_index))
    rep.report(phase="training", step=r.state.step)
    stop.training()

    def beat(at: int, **extra) -> None:
        rep.beat(at, mem_gib=memory_gib(r.device), role="target",
                 recompiles_after_warmup=compile_layer.recompiles_after_warmup(),
                 last_recompile=compile_layer.last_recompile(), **extra)

    step, note = serve_target(target, a.layout, groups, r.state.step, r.data, a.tokenizer.pad_token_id, cfg,
                              r.device, beat)
    beat(step, phase="done", **({"recompile_limit_near": note} if note else {}))


# The compiled variants one capture can add per compiled function: the layers of one class share one graph per
# shape, and a class whose layers differ in a guarded attribute (sliding-window and full attention) takes two.
CAPTURE_VARIANTS = 2


def serve_target(target: TargetCapture, layout: SplitLayout, groups, start_step: int, data, pad_id: int, cfg: Config,
                 device: torch.device, heartbeat) -> tuple[int, Optional[str]]:
    """A target rank of the split placement: compute the captures the drafter ranks ask for, in
    schedule order, until each has said stop. Before each capture, the recompile-limit check: once a
    compiled function could reach the limit within the captures this rank may still be asked for before the
    drafter ranks can stop (`SplitLayout.captures_until_stop`), every capture carries that news to its drafter
    rank (transport.py, Notes), and the drafter ranks stop the run at a step boundary with a checkpoint.
    Returns the step it stopped at and that note (None: the limit was never near)."""
    outbox = TargetOutbox(layout, cfg.data.token_budget, cfg.data.max_batch_size, device)
    ahead = CAPTURE_VARIANTS * layout.captures_until_stop()
    t0 = time.perf_counter()
    at, note = start_step, None
    for m, rows in layout.produced(torch.distributed.get_rank(), groups, start_step):
        if not outbox.next_ticket(m):
            break
        if note is None:
            note = compile_layer.recompile_headroom_error(ahead)
            if note is not None:
                log.warning("%s; telling the drafter ranks, which stop the run at a step boundary with a checkpoint",
                            note)
        batch = collate([data.example(i) for i in rows], pad_id).to(device)
        outbox.send(m, batch, target(batch.input_ids), note)
        at = m // layout.per_step + 1
        busy = time.perf_counter() - t0 - outbox.wait_s
        heartbeat(at, produced=outbox.sent, wait_s=round(outbox.wait_s, 2), busy_s=round(busy, 2))
    outbox.close()
    log.info("target rank served %d micro-batches; %.1f s waiting for the drafters", outbox.sent, outbox.wait_s)
    return at, note
