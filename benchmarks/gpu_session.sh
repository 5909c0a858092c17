#!/usr/bin/env bash
# One device call that checks and measures the GPU path (about 9-10 minutes on an H200; with
# TESTS_ONLY=1 only the tests, about 5): the GPU tests, then the engine benchmark at the 2B and 27B shapes (bf16 and 4-bit, with
# transformers and a drafter for comparison; split by --shape over two calls if 330 s is not
# enough). Run from the repository root on the device
# machine, after `bash benchmarks/device_wheels.sh` here and with `.whl` carried:
#   bash benchmarks/gpu_session.sh
# Results: $OUT/tests.log (the two summaries; tests-model.log and tests-ops.log in full),
# $OUT/gpu.json, $OUT/gpu.log (the table is the log's last lines).
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null \
  && export PYTHONPATH=/tmp/site:$PWD/src:$PWD PYTHONUNBUFFERED=1
out=${OUT:-/tmp}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
# The GPU tests in two processes side by side (their first runs are mostly Triton compilation
# and FLA autotuning, on the CPU): about 5 minutes in all on an H200.
gpu_tests() {
  timeout "${TESTS_TIMEOUT:-420}" python -m pytest -q -p no:cacheprovider --durations=5 "$@"
}
gpu_tests tests/test_gpu_model.py tests/test_gpu_nemotron_h.py >"$out/tests-model.log" 2>&1 &
gpu_tests tests/test_gpu_ops.py tests/test_fused_ops.py >"$out/tests-ops.log" 2>&1 &
wait
grep -h -E "passed|failed|error" "$out/tests-model.log" "$out/tests-ops.log" | tee "$out/tests.log"
[ -n "${TESTS_ONLY:-}" ] && exit 0
timeout 300 python benchmarks/gpu_engine.py --shape 2b 27b --format bf16 4bit --hf --spec \
  --out "$out/gpu.json" 2>&1 | grep -v Warning | tee "$out/gpu.log" | tail -6
# TTFT with and without prefill graphs at 27B (about 2-3 minutes; a separate call if needed):
#   python benchmarks/ttft_graphs.py --shape 27b
