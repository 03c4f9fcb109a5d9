"""Small host lists to the device without stalling the host.

`torch.tensor(values, device="cuda")` copies from pageable memory, and such a copy first waits
for everything queued on the stream: in the middle of a step, for the whole forward. Staged in
pinned memory, the copy is queued behind the forward instead and the host goes on launching.
"""

from __future__ import annotations

from typing import Any

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
