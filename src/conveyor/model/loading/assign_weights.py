"""Assign a checkpoint's tensors to a built model's parameters: HF names mapped to ours
(FamilySpec.unstack: a stacked tensor's pieces; renames; then packed_modules: the shards of a
fused weight concatenated), each weight (or, tensor-parallel, its rank's slice) converted to
the target dtype and device, and a weight whose pieces are all the file's quantized blocks
put in a QuantLinear / QuantEmbedding instead (model/cpu/quant_linear.py). loader.py decides
what to load and how.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from conveyor.model.cpu.quant_linear import QuantExperts, QuantTensor, quantized_module
from conveyor.model.distributed.sharding import Shard
from conveyor.model.loading.finite_weights import check_torch_tensor
from conveyor.model.loading.safetensors_mmap import MappedTensor
from conveyor.model.models.llama import LlamaForCausalLM

# Buffers some older checkpoints saved; we recompute them.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def assign_weights(
    model: LlamaForCausalLM,
    tensors: Iterator[tuple[str, torch.Tensor | MappedTensor]],
    dtype: torch.dtype,
    device: torch.device,
    shard: Shard | None = None,
    kernels: Any = None,
    linear_dtype: torch.dtype | None = None,
) -> None:
    """Map HF names to ours, concatenate packed shards and assign every parameter (only
    `shard`'s slice of each, when given), those of linears and embeddings in `linear_dtype`
    (None: `dtype`). A weight whose pieces are all QuantTensors replaces
    its module by a quantized one (with `kernels`); a piece mixed with float ones is
    dequantized.

    A MappedTensor used as is becomes the parameter (the file's pages are its memory); one
    that was copied (converted, moved or concatenated) is released right after, so the
    weights are in memory about once during the load."""
    expected = dict(model.named_parameters())
    packed, renames = model.SPEC.packed_modules, model.SPEC.renames
    shard_counts: dict[str, int] = {}
    for fused, index in packed.values():
        shard_counts[fused] = max(shard_counts.get(fused, 0), index + 1)
    pending: dict[str, dict[int, tuple[str, Any]]] = {}  # fused name -> (HF name, piece)
    unexpected: list[str] = []
    loaded: set[str] = set()
    if model.SPEC.unstack is not None:
        tensors = _unstacked(tensors, model.SPEC.unstack)
    for name, item in tensors:
        if name.endswith(_IGNORED_SUFFIXES) or (name == "lm_head.weight" and model.lm_head is None):
            continue
        if not name.startswith(("model.", "lm_head.")):  # a bare decoder's names
            name = f"model.{name}"
        parts = name.split(".")
        if renames:
            parts = [renames.get(p, p) for p in parts]
            name = ".".join(parts)
        sources = [(name, item)]
        if len(parts) >= 2 and parts[-2] in packed:
            fused, index = packed[parts[-2]]
            ours = ".".join([*parts[:-2], fused, parts[-1]])
            pieces = pending.setdefault(ours, {})
            pieces[index] = (name, item)
            if len(pieces) < shard_counts[fused]:
                continue
            sources = [pieces[i] for i in range(shard_counts[fused])]
            del pending[ours]
            name = ours
        if name not in expected:
            unexpected.append(name)
            continue
        views = [s.tensor if isinstance(s, MappedTensor) else s for _, s in sources]
        if any(isinstance(v, QuantTensor) for v in views):
            if kernels is not None and all(isinstance(v, QuantTensor) for v in views):
                _set_quantized(model, name, views, kernels)
                loaded.add(name)
                continue
            views = [v.dequantize() if isinstance(v, QuantTensor) else v for v in views]
        if shard is not None:
            views = [shard.slice(n, v) for (n, _), v in zip(sources, views, strict=True)]
        for (source_name, source), view in zip(sources, views, strict=True):
            if isinstance(source, MappedTensor):  # GGUF tensors were checked as they were read
                check_torch_tensor(source_name, view)
        owner = model.get_submodule(name.rpartition(".")[0])
        weights = isinstance(owner, (nn.Linear, nn.Embedding))
        as_dtype = (linear_dtype or dtype) if weights else dtype
        tensor = views[0] if len(views) == 1 else _cat_as(views, as_dtype, device)
        value = _set_parameter(model, name, expected[name], tensor, as_dtype, device)
        for (_, source), view in zip(sources, views, strict=True):
            if isinstance(source, MappedTensor) and value.data_ptr() != view.data_ptr():
                source.release()
        loaded.add(name)
    missing = sorted(set(expected) - loaded)
    if pending:
        missing += [f"{n} (only shards {sorted(p)} found)" for n, p in pending.items()]
    if missing or unexpected:
        raise ValueError(
            f"Checkpoint does not match {type(model).__name__}: missing weights "
            f"{missing or 'none'}; unexpected weights {sorted(unexpected) or 'none'}."
        )


def _unstacked(
    tensors: Iterator[tuple[str, torch.Tensor | MappedTensor]], unstack: Callable[..., Any]
) -> Iterator[tuple[str, torch.Tensor | MappedTensor]]:
    """The tensors, each that `unstack` divides (FamilySpec.unstack) replaced by its pieces:
    views of it, checked for finite values as a whole. A mapped one is released once its
    pieces are assigned; a contiguous piece is cloned first, as a parameter could alias it.
    A QuantExperts' pieces are QuantTensors of their own bytes."""
    for name, item in tensors:
        view = item.tensor if isinstance(item, MappedTensor) else item
        pieces = unstack(name, view) if isinstance(view, torch.Tensor | QuantExperts) else None
        if pieces is None:
            yield name, item
            continue
        if isinstance(item, MappedTensor):
            check_torch_tensor(name, view)
        for piece_name, piece in pieces:
            if isinstance(piece, torch.Tensor) and piece.is_contiguous():
                piece = piece.clone()
            yield piece_name, piece
        if isinstance(item, MappedTensor):
            item.release()


def _set_parameter(
    model: nn.Module,
    name: str,
    placeholder: nn.Parameter,
    tensor: torch.Tensor,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    if tuple(tensor.shape) != tuple(placeholder.shape):
        raise ValueError(
            f"Weight {name} has shape {tuple(tensor.shape)}, expected {tuple(placeholder.shape)}."
        )
    module_name, _, leaf = name.rpartition(".")
    value = tensor.to(device=device, dtype=dtype).contiguous()
    setattr(model.get_submodule(module_name), leaf, nn.Parameter(value, requires_grad=False))
    return value


def _set_quantized(model: nn.Module, name: str, parts: list[QuantTensor], kernels: Any) -> None:
    """Replace the module owning weight `name` by its quantized stand-in holding `parts`."""
    module_name, _, leaf = name.rpartition(".")
    if leaf != "weight":
        raise ValueError(f"Weight {name} is quantized, but only weights of linears can be.")
    parent_name, _, child = module_name.rpartition(".")
    try:
        replacement = quantized_module(model.get_submodule(module_name), parts, kernels)
    except ValueError as exc:
        raise ValueError(f"Weight {name}: {exc}") from None
    setattr(model.get_submodule(parent_name), child, replacement)


def _cat_as(pieces: list[torch.Tensor], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The pieces of a fused weight concatenated straight into the target dtype and device,
    without an intermediate copy in the file's dtype."""
    rows = sum(p.shape[0] for p in pieces)
    out = torch.empty((rows, *pieces[0].shape[1:]), dtype=dtype, device=device)
    start = 0
    for p in pieces:
        if tuple(p.shape[1:]) != tuple(out.shape[1:]):
            raise ValueError(
                f"Packed weight pieces have shapes {[tuple(x.shape) for x in pieces]}, which "
                "cannot be concatenated."
            )
        out[start : start + p.shape[0]].copy_(p)
        start += p.shape[0]
    return out
