"""Peak live tensor memory of a piece of code, on any device, from Python.

A ``TorchDispatchMode`` sees every tensor an op returns; each new storage is counted until it is freed (a weak
reference to the storage fires then). Kernel-internal scratch buffers and communication-library buffers are not
tensors returned to Python and are not counted: this measures the algorithm's own tensors, which is what differs
between ring attention and its alternatives.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class PeakTensorMemory(TorchDispatchMode):
    """``with PeakTensorMemory() as memory: ...`` then ``memory.peak_bytes``."""

    def __init__(self):
        super().__init__()
        self.live_bytes = 0
        self.peak_bytes = 0
        self._seen: set[int] = set()

    def _release(self, key: int, nbytes: int) -> None:
        self.live_bytes -= nbytes
        self._seen.discard(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_leaves(out):
            if not isinstance(tensor, torch.Tensor):
                continue
            storage = tensor.untyped_storage()
            key, nbytes = storage.data_ptr(), storage.nbytes()
            if nbytes == 0 or key in self._seen:
                continue
            self._seen.add(key)
            self.live_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
            weakref.finalize(storage, self._release, key, nbytes)
        return out
