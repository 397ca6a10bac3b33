"""Where cache pools live: host numpy arrays, or torch tensors on the engine's device.

A CachePool (runtime/cache.py) keeps its arrays in one of these and writes rows only through them, so the same
pool, commit and prefix-cache code serves both:
- `HostArrays`: numpy in host memory, read in place by ONNX Runtime's CPU provider. bf16 is ml_dtypes' bfloat16
  (numpy has none of its own), so a host array of a bf16 engine has its real element type.
- `DeviceArrays`: torch tensors on one device (a GPU; "cpu" runs the same path on machines without one). The
  sessions hand them to the engine by address or by DLPack, never by copy, and the rows a call produces stay on
  the device when the backend leaves them there (TensorRT, ONNX Runtime CUDA). Writes are deferred: `flush`
  writes every sequence's rows of a step with one `index_put_` per pool, so a step costs a few launches per cache
  group whatever the batch (V4-Flash has about 200 groups: one launch per group and sequence would cost more than
  the step). Rows that arrive on the host (a backend that returns them there) move once, just the rows.
torch is imported only by DeviceArrays: the runtime's CPU path never needs it.
"""
from __future__ import annotations

import os
import resource
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

NUMPY_DTYPES = {"fp32": np.float32, "fp16": np.float16, "bf16": ml_dtypes.bfloat16}   # engine dtype -> numpy


def to_numpy(value: Any) -> np.ndarray:
    """A host numpy array of a torch tensor (any device; bf16 as ml_dtypes' bfloat16) or of a numpy array."""
    if isinstance(value, np.ndarray):
        return value
    tensor = value.detach().cpu()
    if str(tensor.dtype) == "torch.bfloat16":       # numpy cannot take torch's bfloat16: through its bits
        import torch

        return tensor.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return tensor.numpy()


def to_torch(array: np.ndarray) -> Any:
    """A torch CPU tensor sharing a numpy array's memory (bf16 through its bits)."""
    import torch

    if array.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)


def host_memory() -> int:
    """Bytes of host memory this process may take: the machine's physical memory, or less where the process is held
    to less: its address-space limit (`ulimit -v`), less what it maps already, or its cgroup's memory.max."""
    page = os.sysconf("SC_PAGE_SIZE")
    limits = [page * os.sysconf("SC_PHYS_PAGES")]
    address_space, _ = resource.getrlimit(resource.RLIMIT_AS)
    if address_space != resource.RLIM_INFINITY:
        try:
            mapped = int(Path("/proc/self/statm").read_text().split()[0]) * page
        except (OSError, ValueError, IndexError):
            mapped = 0
        limits.append(max(0, address_space - mapped))
    try:
        limits.append(int(Path("/sys/fs/cgroup/memory.max").read_text()))   # "max" when unlimited
    except (OSError, ValueError):
        pass
    return min(limits)


class HostArrays:
    """Pools as numpy arrays in host memory."""

    device = None

    def __init__(self, dtype: str):
        self.dtype = NUMPY_DTYPES[dtype]

    def zeros(self, shape: tuple[int, ...]) -> np.ndarray:
        """Allocated zeroed and untouched: a large pool costs memory only as its rows are written."""
        return np.zeros(shape, self.dtype)

    def memory(self) -> int:
        return host_memory()

    def write(self, pool: np.ndarray, index: tuple[np.ndarray, np.ndarray], rows: Any) -> None:
        pool[index] = to_numpy(rows)

    def flush(self) -> None:
        """Nothing to do: host writes are immediate."""

    def clone(self, value: np.ndarray) -> np.ndarray:
        return value.copy()


class DeviceArrays:
    """Pools as torch tensors on `device` ("cuda:0", or "cpu" for the same path without a GPU)."""

    def __init__(self, dtype: str, device: str):
        import torch

        self.torch, self.device = torch, torch.device(device)
        self.dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[dtype]
        self._pending: dict[int, tuple[Any, list[np.ndarray], list[Any]]] = {}     # id(pool) -> pool, indices, rows

    def memory(self) -> int:
        """Bytes free on the device now (after the weights): device pools are allocated whole. On the CPU, the
        host's."""
        if self.device.type == "cuda":
            return self.torch.cuda.mem_get_info(self.device)[0]
        return host_memory()

    def zeros(self, shape: tuple[int, ...]) -> Any:
        return self.torch.zeros(shape, dtype=self.dtype, device=self.device)

    def write(self, pool: Any, index: tuple[np.ndarray, np.ndarray], rows: Any) -> None:
        """pool[index] = rows at the next flush: index (first, second) row coordinates, rows as they come (on the
        device from TensorRT or ONNX Runtime CUDA; from the host otherwise)."""
        _, indices, values = self._pending.setdefault(id(pool), (pool, [], []))
        indices.append(np.stack(index))
        values.append(to_torch(rows) if isinstance(rows, np.ndarray) else rows)

    def flush(self) -> None:
        """Every pending write: per pool, one transfer of the indices, one concatenation of the rows (where they
        are), one index_put_ on the device. On a GPU it returns once they are done: the engines run on streams of
        their own (TensorRT's, ONNX Runtime's), which must neither read a pool before its rows land nor reuse an
        output buffer the concatenation still reads."""
        torch = self.torch
        pending, self._pending = self._pending, {}     # taken first: a failed write is not retried forever
        for pool, indices, values in pending.values():
            where = torch.from_numpy(np.concatenate(indices, axis=1)).to(self.device, non_blocking=True)
            rows = torch.cat([v.to(self.device, self.dtype, non_blocking=True) for v in values])
            pool.index_put_((where[0], where[1]), rows)
        if pending and self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def clone(self, value: Any) -> Any:
        return value.clone()


PoolArrays = HostArrays | DeviceArrays


def pool_arrays(dtype: str, device: str | None) -> PoolArrays:
    """Host numpy arrays when `device` is None, torch tensors on it otherwise."""
    return HostArrays(dtype) if device is None else DeviceArrays(dtype, device)
