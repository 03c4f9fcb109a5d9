#!/usr/bin/env bash
# The checks that need a CUDA GPU (our CPU machines have none), as one script for a short
# device window: each stage has its own time limit and a failing stage does not stop the next.
#
#   bash benchmarks/gpu_check.sh          # from the repository root; about 7 minutes on an H200
#
# 1. The tests compiled on CUDA: with TRITON_INTERPRET unset and a GPU present, the
#    `interpreter` tests run the kernels on CUDA against the torch reference (also on CUDA),
#    plus end-to-end LLM(attention_backend="triton") greedy parity, int8 included, the fused
#    norm / rotary / activation kernels (tests/kernels/test_fused_kernels.py), and
#    tests/model/test_decode_graphs.py: CUDA graphs captured and replayed against
#    enforce_eager, and the KV cache sized from free GPU memory;
#    tests/server/test_cuda_serve.py: `conveyor serve` as
#    the cuda Docker image runs it (needs fastapi, uvicorn and pydantic importable).
# 2. benchmarks/cuda_decode.py: output tok/s at 1, 16, 64, 256 streams, eager against CUDA
#    graphs (with and without conveyor.kernels.fused), and the split of a decode step
#    (Qwen2.5-0.5B's shape, bf16, random weights).
# 3. benchmarks/attention.py: decode and mixed batches, bf16, Llama-8B heads; bandwidth, ratio
#    to peak, speedup over SDPA on gathered K/V; the tile sweep; then a shorter int8 sweep.
# Results go to $OUT (the device runner's output folder) or benchmarks/results/. The package
# must import there: on a bare CUDA image carry the missing wheels (gguf, fastapi, uvicorn,
# pydantic, httptools, ...) and put them on PYTHONPATH first.
set -uo pipefail
cd "$(dirname "$0")/.."
unset TRITON_INTERPRET
export PYTHONUNBUFFERED=1
out="${OUT:-benchmarks/results}"
mkdir -p "$out"
PY="${PYTHON:-python3}"
$PY -c "import torch; assert torch.cuda.is_available(), 'no CUDA GPU'; print(torch.cuda.get_device_name())" || exit 1
if ! $PY -c "import conveyor.kernels.launchers" 2>/dev/null; then
    export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the checkout, uninstalled
fi
{ nvidia-smi; $PY -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"; } > "$out/env.txt" 2>&1
stage() {  # stage NAME SECONDS COMMAND...
    local name=$1 limit=$2; shift 2
    local t0=$SECONDS
    echo "=== $name (limit ${limit}s)"
    timeout "$limit" "$@"
    echo "=== $name: rc=$? in $((SECONDS - t0))s"
}
stage tests "${TESTS_S:-170}" $PY -m pytest -q -p no:cacheprovider -rs \
    tests/model/test_decode_graphs.py tests/kernels/test_fused_kernels.py \
    tests/kernels/test_kernels.py tests/kernels/test_triton_backend.py \
    tests/server/test_cuda_serve.py \
    tests/model/test_sliding_window.py::test_triton_kernel_applies_the_window \
    tests/benchmarks/test_attention_benchmark.py 2>&1 | tee "$out/tests_cuda.txt"
stage cuda_decode "${DECODE_S:-170}" $PY benchmarks/cuda_decode.py \
    ${DECODE_ARGS:---sides eager graphs graphs-unfused} --out "$out/cuda_decode.json"
[ -s "$out/cuda_decode.json" ] || stage cuda_decode_eager "${DECODE_S:-170}" $PY \
    benchmarks/cuda_decode.py --sides eager --streams 1 64 --repeats 1 --out "$out/cuda_decode.json"
# ATTENTION_ARGS / INT8_ARGS: e.g. "--tile-sweep" (every tiling at batch 64 x 4k and a mixed
# batch), or smaller --batches / --contexts lists.
stage attention_bf16 "${ATTENTION_S:-100}" $PY benchmarks/attention.py --contexts 512 2048 4096 8192 \
    ${ATTENTION_ARGS:-} --out "$out/attention_bf16.json" 2>&1 | tail -3
stage attention_int8 "${INT8_S:-40}" $PY benchmarks/attention.py --kv-cache-dtype int8 \
    --batches 32 128 --contexts 2048 8192 --mixed-batches 32 ${INT8_ARGS:-} \
    --out "$out/attention_int8.json" 2>&1 | tail -3
$PY - "$out" <<'PYEOF'
import json, os, sys
for name in ("attention_bf16.json", "attention_int8.json"):
    path = f"{sys.argv[1]}/{name}"
    if not os.path.exists(path):
        print(name, "missing"); continue
    report = json.load(open(path))
    print(name, report["device"], "peak", report["peak_bandwidth_GBps"], "GB/s", report["peak_source"])
    for r in report["results"]:
        print(f'  {r["kind"]:6} batch {r["batch"]:3} ctx {r["context"]:5}: {r["kernel_ms"]:.4f} ms '
              f'{r["bandwidth_GBps"]:7.1f} GB/s ({r["ratio_to_peak"]:.0%} of peak), '
              f'x{r["speedup_vs_sdpa_gathered"]} vs SDPA, x{r["speedup_vs_gather_plus_sdpa"]} '
              f'vs gather+SDPA, max diff {r["max_abs_diff_vs_sdpa"]:.1e}')
    for r in report.get("tile_sweep", []):
        print("  sweep", r)
PYEOF
