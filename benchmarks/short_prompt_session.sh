#!/usr/bin/env bash
# One device call for issue #16's short-prompt row (one new 27B 4-bit prompt of 31 tokens):
# the engine's TTFT with prompt graphs (benchmarks/ttft_graphs.py), the padded forward's GPU
# kernels (benchmarks/profile_prefill.py prof31pad) and new prompts' GDN per layer
# (benchmarks/gdn_padded.py: FLA, the one-row steps, the fused chunk), after the GPU tests of
# the fused chunk and the padded path. Run from the repository root on the device machine with
# `.whl` carried (see benchmarks/device_wheels.sh); BASE=DIR (a `git archive` of another tree's
# src and benchmarks, carried too) also times that tree's TTFT and kernels first, on the same
# machine. Logs go to $OUT; the tables are printed last.
#   BASE=.base bash benchmarks/short_prompt_session.sh
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1
out=${OUT:-/tmp}
# The fused chunk's and the padded path's GPU tests first: a failure shows before any timing.
PYTHONPATH=/tmp/site:$PWD/src:$PWD timeout "${TEST_S:-150}" python3 -m pytest -q -x \
  tests/test_fused_ops.py -k "fresh_chunk or gdn_padded or conv_padded" >"$out/tests.txt" 2>&1
echo "tests rc=$?: $(tail -1 "$out/tests.txt")"
trees=${BASE:+$BASE }.
for tree in $trees; do
  root=$(cd "$tree" && pwd)
  name=$(basename "$root")
  export PYTHONPATH=/tmp/site:$root/src:$root
  timeout "${TTFT_S:-150}" python3 "$root/benchmarks/ttft_graphs.py" --shape 27b --format 4bit \
    --settings 1 >"$out/ttft-$name.txt" 2>&1
  HEADSTART_PDL=0 timeout "${PROF_S:-90}" python3 "$root/benchmarks/profile_prefill.py" \
    --shape 27b --format 4bit --parts prof31pad --top 20 >"$out/prof-$name.txt" 2>&1
done
export PYTHONPATH=/tmp/site:$PWD/src:$PWD
timeout "${GDN_S:-120}" python3 benchmarks/gdn_padded.py --shapes 27b \
  --cases 1x16,1x32,16x32 --fused >"$out/gdn.txt" 2>&1
for tree in $trees; do
  name=$(basename "$(cd "$tree" && pwd)")
  echo "== $name"
  tail -2 "$out/ttft-$name.txt"
  grep -A6 "eager wall" "$out/prof-$name.txt"
done
grep -v "Autotun\|with key\|finished after\|best config\|^$" "$out/gdn.txt" | tail -20
