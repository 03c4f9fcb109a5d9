"""The Triton kernels' launchers: paged attention and the paged KV write, and whether Triton
runs them compiled or interpreted.

kernels/ (installed as `conveyor.kernels`) has no __init__.py: it is a namespace package, so a
checkout's root on sys.path (`python -m pytest`, `python -c`, `python -m conveyor` run there)
never shadows Hugging Face's `kernels` package, which transformers imports from 5.25 on (a
namespace portion loses to any regular package of the same name). Import this module:
`import conveyor.kernels.launchers as kernels`.

Each kernel file holds one `@triton.jit` kernel (plus its helpers) and a thin launcher that
checks shapes, strides and dtypes and raises ValueError. The torch reference each kernel is
tested against lives in `conveyor.model.attention.torch_attention` and `conveyor.model.kv_cache`.

Triton decides at decoration time (when this module is imported) whether its kernels run
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
