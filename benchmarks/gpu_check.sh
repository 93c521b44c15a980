#!/usr/bin/env bash
# One device call: the full-size GPU tests, the demo, and the benchmark suites, logs under $OUT.
# Usage (on the GPU machine): bash benchmarks/gpu_check.sh [tests|bench|all] [suite]
set -uo pipefail
what=${1:-all}
suite=${2:-design}
out=${OUT:-out}
mkdir -p "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv | tee "$out/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$out/gpu.txt"
status=0
if [ "$what" = tests ] || [ "$what" = all ]; then
  python3 -m pytest -q -n 8 -p no:cacheprovider tests 2>&1 | tee "$out/tests.log" | tail -40
  status=${PIPESTATUS[0]}
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  python3 -m blockattn.cli demo --out "$out/demo-mask.png" 2>&1 | grep -v "demo:" | tee "$out/demo.log"
  python3 benchmarks/bench_attention.py --suite "$suite" --out "$out/bench-$suite" 2>&1 | grep -v "bench:" | tee "$out/bench.log"
fi
exit $status
