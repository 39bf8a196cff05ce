"""Loading this rank's target: whole (its first decoder layers in FP8 under `target.quantize: fp8`), or its
shard of a sharded (`target.sharding: fsdp`) or tensor-parallel (`tp`) target."""

from __future__ import annotations

from ...config.schema import Config
from ...target.capture import load_target_model
from ...target.shard import SHARD_DIM, load_sharded_target, peak_host_gib
from ...target.tensor_parallel import load_tp_target
from ...run.reporter import Reporter
from .rank_checks import Plan
from .rank_setup import RankSetup


def load_target(cfg: Config, plan: Plan, r: RankSetup, rep: Reporter):
    """This rank's target model: whole, or (`target.sharding: fsdp` or `tp`) its shard, read alone from the
    checkpoint; then each rank's peak host memory goes to its heartbeat."""
    if r.target_mesh is None:
        return load_target_model(plan.target_path, plan.target_dtype, r.device, cfg.target.trust_remote_code,
                                 plan.target_fp8_layers)
    load = load_tp_target if cfg.target.sharding == "tp" else load_sharded_target
    model = load(plan.target_path, plan.target_dtype, r.device, r.target_mesh, cfg.target.trust_remote_code)
    rep.beat_fields["host_peak_gib"] = round(peak_host_gib(), 2)
    rep.report(target_sharding=cfg.target.sharding, target_shard_ranks=r.target_mesh[SHARD_DIM].size(),
               host_peak_gib=rep.beat_fields["host_peak_gib"])
    return model
