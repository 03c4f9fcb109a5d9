"""Paged-attention kernel benchmark: conveyor's Triton kernel against SDPA on gathered K/V.

On CUDA, with Llama-8B-like heads (32 query heads, 8 KV heads, head size 128, bf16, block 16):
  - decode batches: batch 1..256 x context 512..8k, one new token per request;
  - mixed batches: the same decodes plus one 512-token prefill chunk on top of a context.
For each shape: the kernel's time; its achieved bandwidth = the bytes attention must move at
least (every request's K/V once, q and the output) / time, and that over the device's peak
(datasheet numbers for H100/H200 by device name, else a measured device-to-device copy);
torch SDPA's time over K/V already gathered into contiguous tensors (its best case), and
gather + SDPA (what a gather-based backend pays). Prints one JSON object.

On CPU it runs one tiny shape to prove the script works: the Triton kernel when
TRITON_INTERPRET=1 is set (the interpreter), else the torch reference; the times mean nothing.

    python benchmarks/attention.py                      # the sweep (CUDA)
    python benchmarks/attention.py --quick              # one small shape
    python benchmarks/attention.py --kv-cache-dtype int8
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from conveyor.model.attention.metadata import AttentionMetadata, build_attention_metadata
from conveyor.model.attention.torch_attention import paged_attention as torch_paged_attention
from conveyor.model.kv_cache import QuantizedKVCache, gather_kv

# Datasheet HBM bandwidth (bytes/s), matched against torch.cuda.get_device_name().
PEAK_BANDWIDTH = [
    ("H200", 4.8e12),
    ("H100 NVL", 3.9e12),
    ("H100 PCIe", 2.0e12),
    ("H100", 3.35e12),  # SXM5 (HBM3), e.g. "NVIDIA H100 80GB HBM3"
]
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def peak_bandwidth(device: torch.device) -> tuple[float, str]:
    """(bytes/s, where the number comes from) for the device."""
    name = torch.cuda.get_device_name(device)
    for key, peak in PEAK_BANDWIDTH:
        if key in name:
            return peak, f"datasheet ({name})"
    src = torch.empty(1 << 28, dtype=torch.uint8, device=device)  # 256 MiB
    dst = torch.empty_like(src)
    ms = _time(lambda: dst.copy_(src), device)
    return 2 * src.numel() / (ms * 1e-3), f"measured copy ({name})"


def _time(fn: Callable[[], object], device: torch.device) -> float:
    """Milliseconds per call (CUDA: triton's do_bench, which flushes L2 between calls)."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=25, rep=100))
    fn()
    start = time.perf_counter()
    for _ in range(3):
        fn()
    return (time.perf_counter() - start) / 3 * 1e3


def make_batch(
    q_lens: list[int], seq_lens: list[int], args: argparse.Namespace, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor | QuantizedKVCache, AttentionMetadata]:
    """Random q, a random paged cache holding every request's context, and the metadata."""
    bs, hkv, d, dtype = args.block_size, args.kv_heads, args.head_size, _DTYPES[args.dtype]
    counts = [-(-s // bs) for s in seq_lens]
    ids = list(range(1, sum(counts) + 1))
    random.Random(0).shuffle(ids)  # scattered blocks, as after a while of serving
    tables, start = [], 0
    for n in counts:
        tables.append(ids[start : start + n])
        start += n
    meta = build_attention_metadata(q_lens, seq_lens, tables, bs, device)
    gen = torch.Generator(device).manual_seed(0)
    shape = (2, sum(counts) + 1, bs, hkv, d)
    if args.kv_cache_dtype == "int8":
        data = torch.randint(-127, 128, shape, dtype=torch.int8, device=device, generator=gen)
        scales = torch.rand(shape[:4], device=device, generator=gen) / 64
        cache: torch.Tensor | QuantizedKVCache = QuantizedKVCache(data, scales)
    else:
        cache = torch.randn(shape, dtype=dtype, device=device, generator=gen)
    q = torch.randn(sum(q_lens), args.q_heads, d, dtype=dtype, device=device, generator=gen)
    return q, cache, meta


def kernel_fn(
    q, cache, meta: AttentionMetadata, scale: float, tuning: tuple[int, int, int] | None = None
) -> Callable[[], torch.Tensor]:
    """The paged attention under test: Triton, or the torch reference when Triton can't run."""
    if q.is_cuda or os.environ.get("TRITON_INTERPRET") == "1":
        import conveyor.kernels.launchers as kernels

        data, scales = (cache.data, cache.scales) if isinstance(cache, QuantizedKVCache) else (
            cache, None)  # fmt: skip
        return lambda: kernels.paged_attention(
            q, data, meta.block_tables, meta.seq_lens, meta.query_start_loc, scale,
            meta.max_query_len, meta.max_seq_len, kv_scales=scales, tuning=tuning,
        ).view(q.shape[0], -1)  # fmt: skip
    new = q.new_zeros(0)  # every chunk in this benchmark has cached context: k/v unused
    return lambda: torch_paged_attention(q, new, new, cache, meta, scale)


def sdpa_fns(q, cache, meta: AttentionMetadata, scale: float):
    """(SDPA over pre-gathered contiguous K/V, gather + SDPA): each returns [T, Hq * D]."""
    _, _, block, hkv, d = (cache.data if isinstance(cache, QuantizedKVCache) else cache).shape
    decodes = [b for b, n in enumerate(meta.query_lens_cpu) if n == 1]
    if len({meta.seq_lens_cpu[b] for b in decodes}) > 1:
        raise ValueError("this baseline attends all decodes in one SDPA: give them one length")
    chunks = [b for b, n in enumerate(meta.query_lens_cpu) if n > 1]
    starts = meta.query_start_loc.tolist()

    def gather():
        parts = []
        for group in ([decodes] if decodes else []) + [[b] for b in chunks]:
            length = max(meta.seq_lens_cpu[b] for b in group)
            nb = -(-length // block)
            ids = meta.block_tables[group, :nb].reshape(-1).long()
            kv = torch.stack(gather_kv(cache, ids, q.dtype)).view(2, len(group), nb * block, hkv, d)
            kv = kv[:, :, :length]
            parts.append((group, kv.transpose(2, 3).contiguous()))  # [2, n, Hkv, L, D]
        return parts

    def attend(parts):
        out = q.new_empty(q.shape[0], q.shape[1] * q.shape[2])
        for group, kv in parts:
            rows = [starts[b] for b in group]
            if len(group) > 1 or meta.query_lens_cpu[group[0]] == 1:  # decodes, equal lengths
                qd = q[rows].unsqueeze(2)  # [n, Hq, 1, D]
                o = F.scaled_dot_product_attention(qd, kv[0], kv[1], scale=scale, enable_gqa=True)
                out[rows] = o.flatten(1)
                continue
            b = group[0]
            n, s = meta.query_lens_cpu[b], meta.seq_lens_cpu[b]
            qc = q[starts[b] : starts[b] + n].transpose(0, 1).unsqueeze(0)
            allowed = torch.arange(s, device=q.device) <= torch.arange(n, device=q.device)[
                :, None
            ] + (s - n)
            o = F.scaled_dot_product_attention(
                qc, kv[0], kv[1], attn_mask=allowed, scale=scale, enable_gqa=True
            )
            out[starts[b] : starts[b] + n] = o[0].transpose(0, 1).flatten(1)
        return out

    gathered = gather()
    return (lambda: attend(gathered)), (lambda: attend(gather()))


def shape_batch(kind: str, batch: int, context: int, args, device):
    """(q, cache, meta, bytes attention must move at least) for `batch` decodes at `context`
    (plus, mixed, one --chunk prefill chunk on top of a context)."""
    q_lens, seq_lens = [1] * batch, [context] * batch
    if kind == "mixed":
        q_lens.append(args.chunk)
        seq_lens.append(context + args.chunk)
    q, cache, meta = make_batch(q_lens, seq_lens, args, device)
    per_token_head = args.head_size + 4 if args.kv_cache_dtype == "int8" else (
        args.head_size * q.element_size())  # fmt: skip
    kv_bytes = sum(seq_lens) * args.kv_heads * per_token_head * 2
    return q, cache, meta, kv_bytes + 2 * q.numel() * q.element_size()


def run_shape(kind: str, batch: int, context: int, args, device, peak: float) -> dict:
    q, cache, meta, nbytes = shape_batch(kind, batch, context, args, device)
    scale = args.head_size**-0.5
    kernel = kernel_fn(q, cache, meta, scale)
    sdpa, gather_sdpa = sdpa_fns(q, cache, meta, scale)
    err = (kernel().float() - sdpa().float()).abs().max().item()
    ms = _time(kernel, device)
    ms_sdpa, ms_gather = _time(sdpa, device), _time(gather_sdpa, device)
    gbps = nbytes / (ms * 1e-3) / 1e9
    return {
        "kind": kind,
        "batch": batch,
        "context": context,
        "new_tokens": q.shape[0],
        "kernel_ms": round(ms, 4),
        "bandwidth_GBps": round(gbps, 1),
        "ratio_to_peak": round(gbps * 1e9 / peak, 3) if peak else None,
        "sdpa_gathered_ms": round(ms_sdpa, 4),
        "speedup_vs_sdpa_gathered": round(ms_sdpa / ms, 2),
        "gather_plus_sdpa_ms": round(ms_gather, 4),
        "speedup_vs_gather_plus_sdpa": round(ms_gather / ms, 2),
        "max_abs_diff_vs_sdpa": err,
    }


def tile_sweep(args, device, peak: float, cases: list | None = None) -> list[dict]:
    """The kernel's bandwidth at each (TILE_N, num_warps, num_stages) for the target decode
    shape and a mixed one (CUDA; a variant that does not compile is reported, not fatal).
    cases: (kind, batch, context, TILE_Ns, warps, stages) tuples in place of those two."""
    cases = cases or [
        ("decode", args.sweep_batch, args.sweep_context, (16, 32, 64, 128), (4, 8), (2, 3)),
        ("mixed", 32, 2048, (16, 32, 64), (4, 8), (2, 3)),
    ]
    rows = []
    for kind, batch, context, tiles, warps, stages in cases:
        q, cache, meta, nbytes = shape_batch(kind, batch, context, args, device)
        scale = args.head_size**-0.5
        want = kernel_fn(q, cache, meta, scale)().float()
        for tuning in [(t, w, s) for t in tiles for w in warps for s in stages]:
            row: dict = {"kind": kind, "batch": batch, "context": context, "tuning": tuning}
            try:
                fn = kernel_fn(q, cache, meta, scale, tuning)
                row["max_abs_diff"] = (fn().float() - want).abs().max().item()
                ms = _time(fn, device)
                row["kernel_ms"] = round(ms, 4)
                gbps = nbytes / (ms * 1e-3) / 1e9
                row["bandwidth_GBps"] = round(gbps, 1)
                row["ratio_to_peak"] = round(gbps * 1e9 / peak, 3) if peak else None
            except Exception as exc:  # out of shared memory or registers: say so, go on
                row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64, 128, 256])
    p.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 8192])
    p.add_argument("--mixed-batches", type=int, nargs="+", default=[32, 128])
    p.add_argument("--chunk", type=int, default=512, help="prefill chunk of a mixed batch")
    p.add_argument("--q-heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-size", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", default="bfloat16", choices=list(_DTYPES))
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8"])
    p.add_argument("--quick", action="store_true", help="one small shape (implied on CPU)")
    p.add_argument(
        "--tile-sweep",
        action="store_true",
        help="CUDA: also time every (TILE_N, num_warps, num_stages) at --sweep-batch x "
        "--sweep-context decode and a mixed batch",
    )
    p.add_argument("--sweep-batch", type=int, default=64)
    p.add_argument("--sweep-context", type=int, default=4096)
    p.add_argument("--out", default=None, help="also write the JSON here")
    args = p.parse_args(argv)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    peak, peak_source = 0.0, "none (CPU)"
    if device.type == "cuda":
        peak, peak_source = peak_bandwidth(device)
    else:  # a tiny shape the interpreter runs in seconds
        args.quick, args.dtype, args.q_heads, args.kv_heads = True, "float32", 4, 2
        args.head_size, args.chunk = 64, 16
    if args.quick:
        args.batches, args.contexts, args.mixed_batches = [2], [64], [2]
    shapes = [("decode", b, c) for b in args.batches for c in args.contexts]
    shapes += [("mixed", b, c) for b in args.mixed_batches for c in args.contexts]
    with torch.inference_mode():
        results = [run_shape(k, b, c, args, device, peak) for k, b, c in shapes]
    kernel_name = "triton" if device.type == "cuda" else "torch"
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1":
        kernel_name = "triton-interpreter"
    report = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "kernel": kernel_name,
        "peak_bandwidth_GBps": round(peak / 1e9, 1),
        "peak_source": peak_source,
        "heads": [args.q_heads, args.kv_heads, args.head_size],
        "dtype": args.dtype,
        "kv_cache_dtype": args.kv_cache_dtype,
        "block_size": args.block_size,
        "results": results,
    }
    if args.tile_sweep and device.type == "cuda":
        with torch.inference_mode():
            report["tile_sweep"] = tile_sweep(args, device, peak)
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return report


if __name__ == "__main__":
    main()
