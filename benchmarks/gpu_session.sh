#!/usr/bin/env bash
# One device call that checks and measures the GPU path (about 8-9 minutes on an H200):
# the GPU tests, then the engine benchmark at the 2B and 27B shapes (bf16 and 4-bit, with
# transformers and a drafter for comparison; split by --shape over two calls if 330 s is not
# enough). Run from the repository root on the device
# machine, after `bash benchmarks/device_wheels.sh` here and with `.whl` carried:
#   bash benchmarks/gpu_session.sh
# Results: $OUT/tests.log, $OUT/gpu.json, $OUT/gpu.log (the table is the log's last lines).
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null \
  && export PYTHONPATH=/tmp/site:$PWD/src:$PWD PYTHONUNBUFFERED=1
out=${OUT:-/tmp}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
timeout 240 python -m pytest tests/test_gpu_ops.py tests/test_gpu_model.py -q -p no:cacheprovider \
  2>&1 | tail -8 | tee "$out/tests.log"
timeout 300 python benchmarks/gpu_engine.py --shape 2b 27b --format bf16 4bit --hf --spec \
  --out "$out/gpu.json" 2>&1 | grep -v Warning | tee "$out/gpu.log" | tail -6
# TTFT with and without prefill graphs at 27B (about 2-3 minutes; a separate call if needed):
#   python benchmarks/ttft_graphs.py --shape 27b
