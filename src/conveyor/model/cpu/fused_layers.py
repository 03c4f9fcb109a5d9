"""Every decoder layer of a step in one C call (csrc/decoder_layers.c), for the CPU path.

A decode step of a Llama-family model is a few hundred short kernels (per layer: two norms,
four linears, rotary, attention, silu * up). Reached one by one from Python, each costs an
nn.Module call, argument checks, a tensor allocation and a ctypes call, which on a small model
adds up to as long as the kernels themselves (docs/kernels.md#measured-choices).
`FusedLayers` describes every layer's weights to C once (at load), and each step that
qualifies runs all layers and the model's final norm in one call on the same kernels in the
same order: the hidden states are bit for bit the modules' own (tests/model/test_fused_layers.py
holds them to it).

A model qualifies when every layer is the plain Llama layer (Llama, Mistral, Qwen2: no
per-head q/k norm) on our C kernels: RMSNorm, rotary and silu * up in C, the "cpu" attention
backend on a float32 or bfloat16 cache, and every linear a CpuLinear (float32 or bfloat16
panels) or a QuantLinear (GGUF blocks); no tensor parallelism. A step qualifies when its
activations are float32, every attention row is the kernel's (no chunk long enough for SDPA)
and, with GGUF blocks on a build other than AVX-512 without BF16, it has fewer than
quant_linear.GEMM_ROWS tokens (longer ones dequantize the weights into a GEMM: bf16 panels
with AVX512-BF16, float32 on AVX2 and portable builds). Anything else runs the modules, as
before.
"""

from __future__ import annotations

import ctypes
import logging
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from conveyor.model.attention.cpu_attention import CpuAttentionBackend, _CpuPlan, _make_plan
from conveyor.model.attention.torch_attention import step_plan
from conveyor.model.cpu.kernel_structs import (
    MAX_PARTS,
    AttentionRowsC,
    LayerDescC,
    LinearDescC,
    StepDescC,
)
from conveyor.model.cpu.linear import CpuLinear
from conveyor.model.cpu.quant_linear import QuantLinear, q8a_bytes
from conveyor.model.models.layers import GatedMLP, RMSNorm

if TYPE_CHECKING:
    from conveyor.model.attention.metadata import AttentionMetadata

logger = logging.getLogger(__name__)


def describe_linear(module: nn.Module) -> LinearDescC | None:
    """The C description of a CpuLinear or QuantLinear; None for any other linear."""
    if not isinstance(module, CpuLinear | QuantLinear):
        return None
    d = LinearDescC()
    d.n, d.k = module.out_features, module.in_features
    if isinstance(module, CpuLinear):
        packed = module.packed_weight
        if packed.dtype not in (torch.float32, torch.bfloat16) or not packed.is_contiguous():
            return None
        bias = module.bias
        if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()):
            return None
        d.kind = 0 if packed.dtype == torch.float32 else 1
        d.panels = packed.data_ptr()
        d.bias = None if bias is None else bias.data_ptr()
        return d
    launches = module._launches()  # a QuantLinear: its pieces
    if len(launches) > MAX_PARTS:
        return None
    d.kind, d.parts = 2, len(launches)
    for i, (type_id, w, ldw, n, bias, start) in enumerate(launches):
        d.qtype[i], d.w[i], d.ldw[i], d.rows[i], d.qbias[i] = type_id, w, ldw, n, bias
        d.start[i] = start
    return d


def _plain_norm(norm: nn.Module) -> bool:
    return (
        type(norm) is RMSNorm
        and norm.kernels is not None
        and norm.weight.dtype == torch.float32
        and norm.weight.is_contiguous()
    )


class FusedLayers:
    """A model's decoder layers described to csrc/decoder_layers.c (see the module
    docstring); `build` makes one for a model that qualifies."""

    def __init__(self, model: nn.Module, kernels: Any, layers: Any, windows: list) -> None:
        cfg = model.kv_config
        self.model = model  # keeps every weight the descriptors point at alive
        self.kernels = kernels
        self._call = kernels.fns["decoder_layers_f32"]
        self._layers = layers  # ctypes array of LayerDescC
        self._windows = windows  # the distinct sliding windows, in rows_set order
        self._n = len(layers)
        self.hidden, self.inter = cfg.hidden_size, cfg.intermediate_size
        self.hq, self.hkv, self.d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        rope = model.model.rotary_emb
        self._cos_sin = rope.cos_sin_cache
        self._max_position = self._cos_sin.shape[0]
        quant = [m for m in model.model.layers.modules() if isinstance(m, QuantLinear)]
        # a step this long runs the modules (their dequantized GEMM); None: any length
        self._gemm_rows = quant[0].gemm_rows if quant else None
        self._passes_of = quant[0] if quant else None
        self._widest_k = max(cfg.hidden_size, cfg.intermediate_size, self.hq * self.d)
        self._caches_of: tuple[int, int] | None = None  # (id, first pointer) described
        # The step's description, reused: each call sets the fields that change.
        norm = model.model.norm
        self._step = StepDescC(
            hidden=self.hidden, hq=self.hq, hkv=self.hkv, d=self.d, inter=self.inter,
            scale=model.model.layers[0].self_attn.scale, cos_sin=self._cos_sin.data_ptr(),
            final_norm=norm.weight.data_ptr(), final_eps=norm.eps,
        )  # fmt: skip
        self._row_sets = (AttentionRowsC * len(windows))()
        # Float32 scratch a token (o, qkv, attn, gate_up, act), each part on a 64-byte line.
        h, i, w = self.hidden, self.inter, (self.hq + 2 * self.hkv) * self.d
        self._part_widths = (h, w, self.hq * self.d, 2 * i, i)

    @classmethod
    def build(cls, model: nn.Module, kernels: Any) -> FusedLayers | None:
        """The fused layers of `model`, or None (logged at debug) when it does not qualify."""
        why = _why_not(model, kernels)
        if why:
            logger.debug("Decoder layers run module by module: %s.", why)
            return None
        layers = model.model.layers
        windows: list = []
        descs = (LayerDescC * len(layers))()
        for desc, layer in zip(descs, layers, strict=True):
            attn, mlp = layer.self_attn, layer.mlp
            linears = [describe_linear(m) for m in (attn.qkv_proj, attn.o_proj,
                                                     mlp.gate_up_proj, mlp.down_proj)]  # fmt: skip
            if any(x is None for x in linears):
                logger.debug("Decoder layers run module by module: a linear C cannot run.")
                return None
            desc.qkv, desc.o, desc.gate_up, desc.down = linears
            desc.in_norm = layer.input_layernorm.weight.data_ptr()
            desc.post_norm = layer.post_attention_layernorm.weight.data_ptr()
            desc.in_eps = layer.input_layernorm.eps
            desc.post_eps = layer.post_attention_layernorm.eps
            if attn.window not in windows:
                windows.append(attn.window)
            desc.rows_set = windows.index(attn.window)
        return cls(model, kernels, descs, windows)

    def _describe_caches(self, kv_caches: list) -> bool:
        """Point each layer at its cache; False when one is not a float32 or bfloat16 tensor
        the kernel reads."""
        first = kv_caches[0]
        key = (id(kv_caches), first.data_ptr() if isinstance(first, torch.Tensor) else 0)
        if key == self._caches_of:
            return True
        dtypes = set()
        for desc, cache in zip(self._layers, kv_caches, strict=True):
            if not isinstance(cache, torch.Tensor) or not cache.is_contiguous():
                return False
            dtypes.add(cache.dtype)
            desc.k_cache = cache.data_ptr()
            desc.v_cache = cache.data_ptr() + cache.element_size() * cache.stride(0)
        if len(dtypes) != 1 or not dtypes <= {torch.float32, torch.bfloat16}:
            return False
        step = self._step
        step.kv_bf16 = int(dtypes.pop() == torch.bfloat16)
        step.block_size = first.shape[2]
        step.num_slots = first.shape[1] * first.shape[2]
        self._caches_of = key
        return True

    def __call__(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list,
        meta: AttentionMetadata,
    ) -> torch.Tensor | None:
        """Run every layer, then the model's final norm, on the embeddings x [T, hidden] (they
        become the residual stream, in place, as the modules use them): the final hidden
        states [T, hidden], or None when this step does not qualify (the caller runs the
        modules)."""
        t = x.shape[0]
        slots = meta.slot_mapping
        if (
            t == 0
            or (self._gemm_rows is not None and t >= self._gemm_rows)
            or x.dtype != torch.float32
            or x.dim() != 2
            or not x.is_contiguous()
            or meta.max_seq_len > self._max_position
            or positions.dtype != torch.int64
            or not positions.is_contiguous()
            or slots.numel() != t
            or slots.dtype != torch.int64
            or not slots.is_contiguous()
            or not self._describe_caches(kv_caches)
        ):
            return None
        step, row_sets = self._step, self._row_sets
        plans = []
        for i, window in enumerate(self._windows):
            plan = step_plan(
                meta,
                window,
                _CpuPlan,
                lambda w=window: _make_plan(meta, step.block_size, x.dtype, w, self.kernels),
            )
            if plan.chunks:  # a chunk long enough for SDPA: the modules run this step
                return None
            plans.append(plan)
            row_sets[i] = plan.kernel_rows.c  # a copy of the step's checked rows
        passes = self._passes_of.passes if self._passes_of is not None else 1
        # One allocation for the scratch and the quantized activations, parts 64-byte aligned.
        parts = [-(-t * w // 16) * 16 for w in self._part_widths]
        xq_floats = -(-q8a_bytes(passes, t, self._widest_k) // 4)
        scratch = torch.empty(sum(parts) + xq_floats, dtype=torch.float32)
        ptrs = [scratch.data_ptr()]
        for n in parts:
            ptrs.append(ptrs[-1] + 4 * n)
        out = torch.empty(t, self.hidden, dtype=torch.float32)
        step.t, step.passes, step.num_threads = t, passes, torch.get_num_threads()
        step.positions, step.slots = positions.data_ptr(), slots.data_ptr()
        failed = self._call(
            self._layers, self._n, row_sets, ctypes.byref(step), out.data_ptr(), x.data_ptr(),
            *ptrs,
        )  # fmt: skip
        if failed:
            _raise(failed, step.num_slots, plans)
        return out


def _raise(failed: int, num_slots: int, plans: list) -> None:
    layer, code = failed >> 8, failed & 0xFF
    if code & 1:
        raise ValueError(f"layer {layer}: the quantized kernel does not handle a weight's type.")
    bits = code >> 1
    if bits & 4:
        raise ValueError(f"a new token's cache slot is outside [0, {num_slots}).")
    if bits & 2:
        most = max(p.kernel_rows.max_keys for p in plans)
        raise ValueError(f"a row's key range is empty, negative or longer than {most}.")
    raise MemoryError("paged_attention could not allocate its work buffers.")


def _why_not(model: nn.Module, kernels: Any) -> str:
    """Why `model` cannot run its layers in one call ("" when it can)."""
    from conveyor.model.models.llama import LlamaAttention, LlamaDecoderLayer

    if kernels is None or "decoder_layers_f32" not in kernels.fns:
        return "no C kernels"
    if getattr(model, "tp", None) is not None:
        return "tensor parallel"
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if not layers or getattr(inner.rotary_emb, "kernels", None) is None:
        return "not a Llama-family model on the C kernels"
    rope = inner.rotary_emb.cos_sin_cache
    if rope.dtype != torch.float32 or not rope.is_contiguous() or rope.dim() != 2:
        return "the rotary table is not float32"
    passes = {m.passes for m in layers.modules() if isinstance(m, QuantLinear)}
    if len(passes) > 1:
        return "the quantized linears differ in activation passes"
    for layer in layers:
        attn = getattr(layer, "self_attn", None)
        mlp = getattr(layer, "mlp", None)
        if type(layer) is not LlamaDecoderLayer or type(attn) is not LlamaAttention:
            return "a layer is not the plain Llama layer"
        if layer.tp is not None or attn.q_norm is not None:
            return "tensor parallel or per-head q/k norms"
        if type(attn.backend) is not CpuAttentionBackend or attn.backend._kernels is None:
            return "the attention backend is not the C kernel"
        if type(mlp) is not GatedMLP or mlp.kernels is None:
            return "the MLP is not on the C kernels"
        if not (_plain_norm(layer.input_layernorm) and _plain_norm(layer.post_attention_layernorm)):
            return "a norm is not on the C kernels"
    if not _plain_norm(getattr(inner, "norm", None)):
        return "the final norm is not on the C kernels"
    return ""
