"""Triton kernels (installed as `conveyor.kernels`): paged attention and the paged KV write.

Each kernel file holds one `@triton.jit` kernel (plus its helpers) and a thin launcher that
checks shapes, strides and dtypes and raises ValueError. The torch reference each kernel is
tested against lives in `conveyor.model.attention.torch_attention` and `conveyor.model.kv_cache`.

Triton decides at decoration time (when this package is imported) whether its kernels run
compiled on a GPU or in its CPU interpreter (TRITON_INTERPRET=1); `INTERPRETED` records which.
"""

from __future__ import annotations

from triton import knobs

from conveyor.kernels.attention import paged_attention
from conveyor.kernels.kv_write import write_kv

# Read once, like triton.jit did for every kernel above: setting the variable later changes
# nothing for this process's kernels.
INTERPRETED: bool = bool(knobs.runtime.interpret)

__all__ = ["INTERPRETED", "paged_attention", "write_kv"]
