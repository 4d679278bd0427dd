#!/usr/bin/env bash
# One-shot GPU run on a CUDA machine, writing JSON, PNG and logs to $OUT (default ./out). First `gpu-check` (the engine
# compiled in float16/bfloat16 on the tiny preset and mini SDXL and Flux pipelines: recompiles, NaNs, swap ms, images/s
# vs plain diffusers; then the real-width SDXL rows; each case in its own process, at most 150 s each, every row
# printed as it ends), then the swap benchmark: SDXL-size swap latencies in bf16 (pinned host memory, as the engine
# uses on CUDA) and the tiny preset compiled (compile time, recompiles over 10 swaps). A failed check still lets the
# benchmark run; the script then exits non-zero.
# Usage: OUT=/some/dir bash lora_manager/bench/gpu_bench.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-out}
PYTHON=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
"$PYTHON" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name())"
check=0
timeout 620 "$PYTHON" -m lora_manager gpu-check --device cuda --json "$OUT/gpu_check.json" 2>&1 \
    | tee "$OUT/gpu_check.log" || check=$?
timeout 300 "$PYTHON" -m lora_manager bench --scale sdxl --device cuda --dtype bfloat16 --repeats 10 \
    --json "$OUT/bench_gpu.json" --plot "$OUT/bench_gpu.png" 2>&1 | tee "$OUT/bench_gpu.log"
timeout 170 "$PYTHON" -m lora_manager bench --scale tiny --device cuda --compile --repeats 10 \
    --json "$OUT/bench_gpu_tiny.json" --plot "$OUT/bench_gpu_tiny.png" 2>&1 | tee "$OUT/bench_gpu_tiny.log"
exit "$check"
