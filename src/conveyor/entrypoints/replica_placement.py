"""Where each data-parallel replica runs: its own CUDA device, or its own share of the CPU
cores.

On CUDA replica i sees only the i-th visible GPU (CUDA_VISIBLE_DEVICES in its environment); on
CPU the cores this process may use are split into N contiguous groups, one per replica
(sched_setaffinity, and as many torch threads as it has cores). A restarted replica gets the
placement of the one it replaces.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Placement:
    """Where one replica runs: extra environment for its process, and its CPU cores (None:
    not pinned)."""

    env: dict[str, str]
    cpu_cores: tuple[int, ...] | None


def replica_placements(num_replicas: int, device: str) -> list[Placement]:
    """One placement per replica for `device` ("auto", "cpu" or "cuda").

    Raises:
        ValueError: fewer CUDA devices, or CPU cores, than replicas.
    """
    import torch

    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if use_cuda:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        ids = [d.strip() for d in visible.split(",")] if visible else None
        count = len(ids) if ids is not None else torch.cuda.device_count()
        if count < num_replicas:
            raise ValueError(
                f"data_parallel_size={num_replicas} puts each replica on its own GPU, but "
                f"{count} CUDA device(s) are visible; lower --data-parallel-size."
            )
        ids = ids or [str(i) for i in range(count)]
        return [Placement({"CUDA_VISIBLE_DEVICES": ids[i]}, None) for i in range(num_replicas)]
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < num_replicas:
        raise ValueError(
            f"data_parallel_size={num_replicas} gives each replica its own CPU cores, but this "
            f"process may use {len(cores)} core(s); lower --data-parallel-size."
        )
    per, extra = divmod(len(cores), num_replicas)
    placements, start = [], 0
    for i in range(num_replicas):
        size = per + (i < extra)
        placements.append(Placement({}, tuple(cores[start : start + size])))
        start += size
    return placements
