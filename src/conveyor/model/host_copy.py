"""Small host lists and arrays to the device without stalling the host.

`torch.tensor(values, device="cuda")` copies from pageable memory, and such a copy first waits
for everything queued on the stream: in the middle of a step, for the whole forward. Staged in
pinned memory, the copy is queued behind the forward instead and the host goes on launching.
Off CUDA both functions are plain copies.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


def to_device(
    values: Any, device: torch.device | str, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """torch.tensor(values, dtype=dtype) on `device`; on CUDA a non-blocking copy from pinned
    memory."""
    host = torch.tensor(values, dtype=dtype)
    if torch.device(device).type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def to_device_int64(arrays: tuple[np.ndarray, ...], device: torch.device) -> list[torch.Tensor]:
    """int64 copies of `arrays` on `device`, each in its own shape; on CUDA all of them in ONE
    non-blocking copy from pinned memory (a step's metadata: one copy, not six)."""
    if device.type != "cuda":
        return [torch.from_numpy(np.asarray(a, dtype=np.int64)).to(device) for a in arrays]
    sizes = [a.size for a in arrays]
    host = torch.empty(sum(sizes), dtype=torch.int64, pin_memory=True)
    np.concatenate([a.ravel() for a in arrays], out=host.numpy())
    flat = host.to(device, non_blocking=True)
    return [x.view(a.shape) for x, a in zip(flat.split(sizes), arrays, strict=True)]
