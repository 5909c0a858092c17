#!/usr/bin/env bash
# Put every wheel the GPU machine lacks into .whl/ (git-ignored), for the `device` tool's
# machine (Python 3.12, no package index): flash-linear-attention's kernels (fla-core), and the
# server stack that the image does not carry (fastapi and what it imports). On the machine, before anything else:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl \
#     && export PYTHONPATH=/tmp/site:$PWD/src:$PWD PYTHONUNBUFFERED=1
set -euo pipefail
top=$(git rev-parse --show-toplevel)
bash "$top/../shared/tools/gpu-wheels.sh"
# FLA's kernels only (`fla-core`, as pyproject's gpu extra): its layers and models wheel would
# make every process of a start-up import transformers (BENCHMARKS.md, session 35).
rm -f "$top"/.whl/flash_linear_attention-*.whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$top/.whl" fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 pydantic==2.14.4 \
  pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 annotated-doc==0.0.7 \
  opentelemetry-api==1.45.2 orjson==3.13.0 httptools==0.9.0
ls -1 "$top/.whl"
