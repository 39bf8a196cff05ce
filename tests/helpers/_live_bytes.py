"""The peak of the bytes held by tensors created while a `LiveBytes` mode is active: every storage an op returns
that none of its inputs holds is counted from that op until the last tensor on it is gone (a weak reference to the
storage tells). Pre-existing tensors (weights, optimizer state, inputs) are never counted, views and in-place
results are not new storages. CPU, eager: what a step's activations really hold, op by op."""

from __future__ import annotations

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LiveBytes(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self._live: dict[StorageWeakRef, int] = {}
        self.now = 0
        self.peak = 0

    def _sweep(self) -> None:
        for ref in [r for r in self._live if r.expired()]:
            self.now -= self._live.pop(ref)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        held = {StorageWeakRef(t.untyped_storage()) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        self._sweep()
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                ref = StorageWeakRef(storage)
                if ref not in held and ref not in self._live:
                    self._live[ref] = storage.nbytes()
                    self.now += storage.nbytes()
        self.peak = max(self.peak, self.now)
        return out
