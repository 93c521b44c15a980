#!/usr/bin/env bash
# The closing device call: focused tests with full tracebacks, the whole suite at full size, the demo and the design
# benchmark; everything lands under $OUT.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
out=${OUT:-out}; mkdir -p "$out"
python3 -m pytest -q -p no:cacheprovider --tb=long tests/test_backward.py -k "accumulated or deterministic or dq_mode" > "$out/focused.log" 2>&1
tail -3 "$out/focused.log"
bash benchmarks/gpu_check.sh all design
