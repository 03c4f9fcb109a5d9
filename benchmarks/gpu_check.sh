#!/usr/bin/env bash
# The checks of the Triton kernels that need a CUDA GPU (our CPU machines have none).
#
#   bash benchmarks/gpu_check.sh          # from the repository root; a few minutes on an H100/H200
#
# 1. The kernel tests compiled on CUDA: with TRITON_INTERPRET unset and a GPU present, the
#    `interpreter` tests run the kernels on CUDA against the torch reference (also on CUDA),
#    plus end-to-end LLM(attention_backend="triton") greedy parity, int8 included.
# 2. benchmarks/attention.py: decode and mixed batches, bf16, Llama-8B heads; bandwidth, ratio
#    to peak, speedup over SDPA on gathered K/V. Then a shorter int8-cache sweep.
# Results go to $OUT (the device runner's output folder) or benchmarks/results/.
set -euo pipefail
cd "$(dirname "$0")/.."
unset TRITON_INTERPRET
out="${OUT:-benchmarks/results}"
mkdir -p "$out"
python -c "import torch; assert torch.cuda.is_available(), 'no CUDA GPU'; print(torch.cuda.get_device_name())"
python -c "import conveyor.kernels" 2>/dev/null || python -m pip install -q --no-deps --no-build-isolation -e .
python -m pytest -q -p no:cacheprovider -m interpreter \
    tests/test_kernels.py tests/test_triton_backend.py tests/test_attention_benchmark.py \
    2>&1 | tee "$out/kernel_tests_cuda.txt"
python benchmarks/attention.py --out "$out/attention_bf16.json" > /dev/null
python benchmarks/attention.py --kv-cache-dtype int8 --batches 32 128 --contexts 2048 8192 \
    --mixed-batches 32 --out "$out/attention_int8.json" > /dev/null
python - "$out" <<'EOF'
import json, sys
for name in ("attention_bf16.json", "attention_int8.json"):
    report = json.load(open(f"{sys.argv[1]}/{name}"))
    print(name, report["device"], "peak", report["peak_bandwidth_GBps"], "GB/s", report["peak_source"])
    for r in report["results"]:
        print(f'  {r["kind"]:6} batch {r["batch"]:3} ctx {r["context"]:5}: {r["kernel_ms"]:.4f} ms '
              f'{r["bandwidth_GBps"]:7.1f} GB/s ({r["ratio_to_peak"]:.0%} of peak), '
              f'x{r["speedup_vs_sdpa_gathered"]} vs SDPA, x{r["speedup_vs_gather_plus_sdpa"]} '
              f'vs gather+SDPA, max diff {r["max_abs_diff_vs_sdpa"]:.1e}')
EOF
