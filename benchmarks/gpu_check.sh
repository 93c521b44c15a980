#!/usr/bin/env bash
# One device call: the full-size GPU tests, the demo, and the benchmark suites, logs under $OUT.
# Usage (on the GPU machine): bash benchmarks/gpu_check.sh [tests|bench|all] [suite] [test paths...]
# The whole suite takes 460-540 s on the H200, near a device call's 600 s: pass test paths to split it into calls.
# Each test's result is logged as it finishes (-v), so a run cut off by its time limit still names its failures.
set -uo pipefail
what=${1:-all}
suite=${2:-design}
paths=("${@:3}")
[ ${#paths[@]} -eq 0 ] && paths=(tests)
out=${OUT:-out}
mkdir -p "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv | tee "$out/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$out/gpu.txt"
status=0
if [ "$what" = tests ] || [ "$what" = all ]; then
  python3 -m pytest -v -n 8 -p no:cacheprovider -rfE --tb=short "${paths[@]}" > "$out/tests.log" 2>&1
  status=$?
  grep -E "^(FAILED|ERROR)|\[gw[0-9]+\].* (FAILED|ERROR) " "$out/tests.log" | head -40
  tail -3 "$out/tests.log"
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  python3 -m blockattn.cli demo --out "$out/demo-mask.png" 2>&1 | grep -v "demo:" | tee "$out/demo.log"
  python3 benchmarks/bench_attention.py --suite "$suite" --out "$out/bench-$suite" 2>&1 | grep -v "bench:" | tee "$out/bench.log"
fi
exit $status
