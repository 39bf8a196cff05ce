"""One process per device on torch.distributed (NCCL on GPU, gloo on CPU). World size 1 is the same
code path with no process group."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as torch_dist


@dataclass
class DistContext:
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @classmethod
    def from_env(cls) -> "DistContext":
        return cls(int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("LOCAL_RANK", 0)))

    def device(self, requested: torch.device) -> torch.device:
        if requested.type == "cuda":
            if self.local_rank >= torch.cuda.device_count():
                raise RuntimeError(f"rank {self.rank} needs cuda:{self.local_rank}, but only "
                                   f"{torch.cuda.device_count()} GPU(s) are visible")
            torch.cuda.set_device(self.local_rank)
            return torch.device("cuda", self.local_rank)
        return requested

    def init(self, device: torch.device, timeout_s: float = 600, alone_too: bool = False) -> None:
        """The process group of the run's ranks. `alone_too`: a group of one as well (a sharded target's
        device mesh needs one at world size 1), on an in-memory store: no address, no port."""
        if torch_dist.is_initialized() or (self.world == 1 and not alone_too):
            return
        backend = "nccl" if device.type == "cuda" else "gloo"
        if self.world == 1:
            torch_dist.init_process_group(backend, store=torch_dist.HashStore(), rank=0, world_size=1,
                                          timeout=timedelta(seconds=timeout_s))
            return
        torch_dist.init_process_group(backend, rank=self.rank, world_size=self.world,
                                      timeout=timedelta(seconds=timeout_s))

    def close(self) -> None:
        if torch_dist.is_initialized():
            torch_dist.destroy_process_group()


class HostCopy:
    """A small device tensor's value on the host without waiting for the device: `post` queues a copy into
    pinned memory, `landed` says whether the last one has arrived, `value` reads it (waiting if not)."""

    def __init__(self, like: torch.Tensor):
        self.on_gpu = like.device.type == "cuda"
        self.host = torch.zeros_like(like, device="cpu")
        if self.on_gpu:
            self.host = self.host.pin_memory()
        self.event = torch.cuda.Event() if self.on_gpu else None
        self.posted = False

    def post(self, t: torch.Tensor) -> None:
        self.host.copy_(t, non_blocking=True)
        if self.event is not None:
            self.event.record()
        self.posted = True

    def landed(self) -> bool:
        return self.event is None or self.event.query()

    def value(self) -> torch.Tensor:
        if self.event is not None:
            self.event.synchronize()
        return self.host


class StopVote:
    """Whether any rank of `group` asked to stop, agreed without waiting for the device. Each call posts this
    rank's flag to an all-reduce and returns the previous call's result, whose copy to the host has landed
    by then (the step in between still queued on the GPU): every rank stops at the same step, one step after
    the request."""

    def __init__(self, device: torch.device, group=None):
        self.group = group
        self.flag = torch.zeros(1, device=device)
        self.seen = HostCopy(self.flag)

    def __call__(self, flag: bool) -> bool:
        agreed = bool(self.seen.value()[0]) if self.seen.posted else False
        self.flag.fill_(1.0 if flag else 0.0)
        torch_dist.all_reduce(self.flag, op=torch_dist.ReduceOp.MAX, group=self.group)
        self.seen.post(self.flag)
        return agreed
