"""The structs csrc/kernels.h declares, mirrored for ctypes: the paged attention's arguments
(`attention_rows`, `attention_args`; cpu_kernels.py fills them) and the fused decoder layers'
descriptors (`linear_desc`, `layer_desc`, `step_desc`; fused_layers.py fills them). A field
here and its C twin must match in order and type: the C side reads the bytes as laid out."""

from __future__ import annotations

import ctypes

_P, _I64, _I32, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_float
MAX_PARTS = 4  # csrc/kernels.h's MAX_PARTS


class AttentionRowsC(ctypes.Structure):
    """One step's query rows and their keys (attention_rows)."""

    _fields_ = [
        ("block_tables", _P),
        ("bt_stride", _I64),
        ("key_begin", _P),
        ("key_end", _P),
        ("rows", _P),
        ("batch", _P),
        ("n", _I64),
        ("max_keys", _I32),
    ]


class AttentionArgsC(ctypes.Structure):
    """The rest of one attention call (attention_args)."""

    _fields_ = [
        ("q", _P),
        ("q_stride", _I64),
        ("out", _P),
        ("out_stride", _I64),
        ("k_cache", _P),
        ("v_cache", _P),
        ("hq", _I32),
        ("hkv", _I32),
        ("d", _I32),
        ("block_size", _I32),
        ("scale", _F32),
        ("num_threads", _I32),
        ("new_k", _P),
        ("new_k_stride", _I64),
        ("new_v", _P),
        ("new_v_stride", _I64),
        ("slots", _P),
        ("n_new", _I64),
        ("num_slots", _I64),
        ("sinks", _P),
    ]


class LinearDescC(ctypes.Structure):
    """One linear of a fused layer (linear_desc)."""

    _fields_ = [
        ("kind", _I32),
        ("parts", _I32),
        ("n", _I64),
        ("k", _I64),
        ("panels", _P),
        ("bias", _P),
        ("qtype", _I32 * MAX_PARTS),
        ("w", _P * MAX_PARTS),
        ("ldw", _I64 * MAX_PARTS),
        ("rows", _I64 * MAX_PARTS),
        ("start", _I64 * MAX_PARTS),
        ("qbias", _P * MAX_PARTS),
    ]


class LayerDescC(ctypes.Structure):
    """One decoder layer (layer_desc)."""

    _fields_ = [
        ("in_norm", _P),
        ("post_norm", _P),
        ("in_eps", _F32),
        ("post_eps", _F32),
        ("rows_set", _I32),
        ("k_cache", _P),
        ("v_cache", _P),
        ("qkv", LinearDescC),
        ("o", LinearDescC),
        ("gate_up", LinearDescC),
        ("down", LinearDescC),
    ]


class StepDescC(ctypes.Structure):
    """One step of the fused layers (step_desc)."""

    _fields_ = [
        ("t", _I64),
        ("hidden", _I32),
        ("hq", _I32),
        ("hkv", _I32),
        ("d", _I32),
        ("inter", _I32),
        ("block_size", _I32),
        ("kv_bf16", _I32),
        ("passes", _I32),
        ("num_threads", _I32),
        ("scale", _F32),
        ("positions", _P),
        ("cos_sin", _P),
        ("slots", _P),
        ("num_slots", _I64),
        ("final_norm", _P),
        ("final_eps", _F32),
    ]


class MoeArgsC(ctypes.Structure):
    """A mixture of experts' feed-forward (moe_args, csrc/moe.c)."""

    _fields_ = [
        ("t", _I64),
        ("hidden", _I32),
        ("inter", _I32),
        ("top_k", _I32),
        ("num_experts", _I32),
        ("passes", _I32),
        ("num_threads", _I32),
        ("x", _P),
        ("out", _P),
        ("topk_ids", _P),
        ("topk_weights", _P),
        ("gate_up", _P),
        ("down", _P),
        ("xg", _P),
        ("gate_up_out", _P),
        ("act", _P),
        ("y", _P),
        ("xq", _P),
    ]
