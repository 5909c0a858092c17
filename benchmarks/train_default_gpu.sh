#!/usr/bin/env bash
# The default model's training run on the `device` tool's GPU machine, in two calls that each
# fit its 10-minute limit (the one-command form, `python -m training.run --out DIR`, needs
# about 10 minutes in all). Run from the repository root there, with `.whl` carried
# (benchmarks/device_wheels.sh) and, for the second call, `.work` carried:
#   bash benchmarks/train_default_gpu.sh target    # GPU smoke run, the target (5.5 min), GPU tests
#   bash benchmarks/train_default_gpu.sh drafter   # the drafter (4 min) and every evaluation
# or, in one call: bash benchmarks/train_default_gpu.sh all (then the 2B prefill-graph TTFT).
# For `all`, `python -m training.data --tar .work/stdlib.tgz` first packs a standard library
# with its test suite (carry it too). The first call returns the target in $OUT/bundle.tgz.*;
# unpack it here with
#   mkdir -p .work && cat FILES_AT/bundle.tgz.* | tar xz -C .work
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/src:$PWD PYTHONUNBUFFERED=1
out=${OUT:-/tmp/out}
work=/tmp/work
mkdir -p "$out" "$work"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
case "${1:-}" in
  target)
    timeout 150 python -m training.run --out /tmp/smoke --device cuda --steps 5 --drafter-steps 5 \
      --max-chars 150000 --layers 4 --hidden 64 --seq-len 64 --batch 4 --block 4 \
      --eval-prompts 2 --continuations 8 > "$out/smoke.log" 2>&1
    echo "smoke rc=$?"; tail -2 "$out/smoke.log" | cut -c1-1500
    # The GPU tests share the GPU with the (small) training run meanwhile.
    (timeout 400 python -m pytest tests/test_gpu_ops.py tests/test_gpu_model.py -q \
      -p no:cacheprovider > "$out/gputests.log" 2>&1) &
    timeout 420 python -m training.run --out "$work/default_model" --device cuda \
      --target-minutes 5.5 --save-target "$work/target_hf" --no-drafter > "$out/target.log" 2>&1
    echo "target rc=$?"; grep -v "^target step" "$out/target.log" | tail -3 | cut -c1-1500
    wait; echo "gpu tests:"; tail -15 "$out/gputests.log" | cut -c1-300
    grep "^target step" "$out/target.log" | awk 'NR % 20 == 1' | tail -15
    tar czf - -C "$work" target_hf default_model | split -b 15M - "$out/bundle.tgz."
    ;;
  drafter)
    [ -d "$work/target_hf" ] || cp -r .work/target_hf "$work/"
    timeout 560 python -m training.run --out "$work/default_model" --device cuda \
      --drafter-minutes 4 --load-target "$work/target_hf" > "$out/drafter.log" 2>&1
    echo "drafter rc=$?"; grep -v "^drafter step" "$out/drafter.log" | tail -3 | cut -c1-3000
    grep "^drafter step" "$out/drafter.log" | awk 'NR % 10 == 1' | tail -12
    tar czf "$out/default_model.tgz" -C "$work" default_model
    ;;
  all)
    # The one-command form in one call: target (early stopping, at most 2.5 min), drafter
    # (2 min), evaluations; the corpus is .work/stdlib.tgz if carried (a standard library
    # with its test suite), else this machine's. Then TTFT with/without prefill graphs.
    stdlib=()
    if [ -f .work/stdlib.tgz ]; then
      mkdir -p "$work/corpus" && tar xzf .work/stdlib.tgz -C "$work/corpus"
      stdlib=(--stdlib "$work/corpus/stdlib")
    fi
    timeout 420 python -m training.run --out "$work/default_model" --device cuda \
      --target-minutes 2.5 --drafter-minutes 2 --continuations 2048 "${stdlib[@]}" \
      > "$out/all.log" 2>&1
    echo "all rc=$?"; grep -E "^data|validation|stopping|^target:|^drafter( data)?:" "$out/all.log" | tail -14
    tail -1 "$out/all.log" | python3 -c "import json,sys; r=json.loads(sys.stdin.read()); \
      r['target'].pop('loss_history', None); print(json.dumps(r)[:2500])" || tail -3 "$out/all.log"
    tar czf "$out/default_model.tgz" -C "$work" default_model
    left=$((530 - SECONDS))
    [ $left -gt 40 ] && timeout $left python benchmarks/ttft_graphs.py --shape 2b 2>&1 \
      | grep -v Warn | tail -4
    ;;
  *) echo "usage: $0 target|drafter|all"; exit 2 ;;
esac
