"""Paged attention: per-step metadata, the KV cache layout and the attention backends.

One step runs ONE flat varlen batch: request b owns new tokens
query_start_loc[b] .. query_start_loc[b+1]-1, at positions seq_lens[b]-query_lens[b] ..
seq_lens[b]-1, and attends causally to its whole context (cached tokens + new ones), or, in
a layer with a sliding window W, to the last W keys up to its own position (keys p - W + 1 ..
p; blocks wholly before that stay allocated and are not read).

KV cache, one per layer (conveyor.model.kv_cache): [2 (k|v), num_blocks, block_size,
num_kv_heads, head_dim], in the model's dtype or int8 with per-token, per-head scales.
Token position p of request b lives in slot  block_tables[b][p // block_size] * block_size
+ p % block_size  of the flattened [2, num_blocks * block_size, Hkv, D] view:

    block_tables[b] = [7, 2, 9]        block_size = 4, seq_len = 10
    positions  0 1 2 3 | 4 5 6 7 | 8 9 . .
    blocks        7         2        9      -> slot(9) = 9 * 4 + 1 = 37

This package: the metadata and the backends' interface, with what each backend declares it
supports (metadata.py), the registry by name (registry.py: plain Python, which the config
reads), and one module per backend, imported only when picked:

    torch_attention.py   "torch": the reference in plain torch, the ground truth
    cpu_attention.py     "cpu": a C kernel (model/cpu/csrc/paged_attention.c) for decode rows
                         and prefill chunks, SDPA for long chunks
    triton_attention.py  "triton": conveyor.kernels, one KV write and one attention launch

A new backend is one module with an AttentionBackend subclass and one line in registry.py's
_BACKENDS. This file imports nothing: import the submodules themselves.
"""
