"""The peak of tensor bytes alive during a stretch of work, counted as ops make storages (the benches' shared
tracker: what torch.cuda.max_memory_allocated reports on a GPU, on the CPU)."""

from __future__ import annotations

import torch
import torch.utils._pytree as pytree
from torch.distributed.tensor import DTensor
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["TensorPeak", "local"]


class TensorPeak(TorchDispatchMode):
    """The peak of storage bytes alive: the ``held`` tensors, then every storage an op makes until it is freed.
    ``dtensors``: an op on DTensors (an optimizer's step over DTensor parameters) counts its outputs' local
    pieces; else only plain tensors' storages are seen."""

    def __init__(self, held, dtensors: bool = False):
        super().__init__()
        self.alive, self.dtensors = {}, dtensors
        for t in held:
            self._add(t)
        self.peak = self._total()

    def _add(self, t):
        if self.dtensors and isinstance(t, DTensor):
            t = t._local_tensor
        if type(t) is not torch.Tensor or t.device.type == "meta":
            return
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key and (key not in self.alive or self.alive[key].expired()):
            self.alive[key] = StorageWeakRef(storage)

    def _total(self):
        # a storage's size now: FSDP2 frees a whole parameter by resizing its storage to nothing, and back
        self.alive = {k: ref for k, ref in self.alive.items() if not ref.expired()}
        return sum(_nbytes(ref) for ref in self.alive.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._add(t)
        self.peak = max(self.peak, self._total())
        return out


def _nbytes(ref) -> int:
    """A storage's bytes now; none where it went since it was seen alive (a collection freed it meanwhile: one
    plan_peak run lost a rank, and its mesh's rows, to it)."""
    storage = torch.UntypedStorage._new_with_weak_ptr(ref.cdata)
    return 0 if storage is None else storage.nbytes()


def local(t):
    """A DTensor's local piece (what the rank holds), any other tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t
