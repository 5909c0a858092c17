#!/usr/bin/env bash
# The default model's training run on the `device` tool's GPU machine (H200, 10-minute calls).
# Run from the repository root there, with `.whl` (benchmarks/device_wheels.sh) and
# `.work/corpus.tgz` carried; make the corpus here first (the GPU machine's Python has no test
# suite and none of these packages):
#   python -m training.data --tar .work/corpus.tgz
#   bash benchmarks/train_default_gpu.sh all       # everything in one call, ~9.5 min at most
# or in two calls (the first also runs a smoke test and the GPU tests):
#   bash benchmarks/train_default_gpu.sh target    # target + chat pass; returns $OUT/bundle.tgz.*
#   bash benchmarks/train_default_gpu.sh drafter   # drafter + evaluations (carry .work/bundle too)
# unpacking the first call's bundle here with
#   mkdir -p .work/bundle && cat FILES_AT/bundle.tgz.* | tar xz -C .work/bundle
# The result comes back as $OUT/default_model.tgz; unpack it here with
#   tar xzf FILES_AT/default_model.tgz -C src/headstart/   (it holds default_model/)
# Each stage is its own process under its own `timeout`, and each training stage writes its
# weights to default_model/ before anything is evaluated, so a slow stage costs only itself
# and what follows it, never what came before.
# A dry run of the flow on a CPU (toy sizes, no wheels): NO_WHEELS=1 DEVICE=cpu WORK=/tmp/w \
#   EXTRA="--layers 4 --hidden 64 --seq-len 64 --batch 4 --steps 3 ..." bash ... all
set -u
if [ -z "${NO_WHEELS:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD/src:$PWD
fi
export PYTHONUNBUFFERED=1
out=${OUT:-/tmp/out}
work=${WORK:-/tmp/work}
device=${DEVICE:-cuda}
mkdir -p "$out" "$work"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null
if [ ! -f .work/corpus.tgz ]; then
  echo "carry .work/corpus.tgz (python -m training.data --tar .work/corpus.tgz)"; exit 2
fi
tar xzf .work/corpus.tgz -C "$work"
export HEADSTART_CORPUS=$work/corpus
model=$work/default_model
# shellcheck disable=SC2206  # EXTRA is split into words on purpose
run=(python -m training.run --out "$model" --work "$work/run" --device "$device"
  --chat-examples "$work/chat.jsonl" --chat-max-chars 20000000 ${EXTRA:-})

stage() {  # stage NAME SECONDS ARGS...: one stage, its log in $OUT, its last lines shown
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout "$limit" "${run[@]}" --stage "$name" "$@" > "$out/$name.log" 2>&1
  echo "stage $name rc=$? $((SECONDS - t0))s (limit ${limit}s, at ${SECONDS}s)"
  grep -E "^(data|chat data|continuations|target:|chat:|drafter:|stage)|validation|stopping|Error" \
    "$out/$name.log" | tail -6 | cut -c1-300
}

examples() {  # the chat pass's conversations, built on the CPU while the GPU trains the target
  timeout 240 python -m training.chat --examples "$work/chat.jsonl" > "$out/examples.log" 2>&1
}

warm() {  # headstart's kernels compiled (Triton caches them on disk) on the shipped model,
  # which has the new one's shapes, while the target trains: the drafter stage's engine and
  # forwards then start without paying first-use compilation inside their time limit
  timeout 240 python -m training.evaluate --model src/headstart/default_model --device "$device" \
    --prompts 2 --max-tokens 16 --ppl-rows 2 --code-max-tokens 16 > "$out/warm.log" 2>&1
}

summary() {
  tar czf "$out/default_model.tgz" -C "$work" default_model
  du -sb "$model" | cut -f1 | sed 's/^/package bytes on disk: /'
  python -m training.run --out "$model" --summary 2>&1 | tail -20
}

case "${1:-}" in
  all)
    # Budget (an H200; wall seconds): setup ~15, data ~30 (tokenizing, alone: it took 195 s
    # while the jobs below shared the CPU), target 240 (3.2 min of steps), chat 95 (0.85 min),
    # drafter 185 (model load and prompts ~25, continuations at most 60 s, 1.4 min of steps, the
    # export: a limit under their sum kills the stage before it writes the drafter),
    # evaluations until 575.
    stage data 120
    examples & building=$!
    warm & warming=$!
    stage target 240 --target-minutes 3.2
    wait $building $warming
    tail -1 "$out/examples.log"; grep -c . "$out/warm.log" | sed 's/^/kernel warm-up log lines: /'
    stage chat 95 --chat-minutes 0.85
    stage drafter 185 --drafter-minutes 1.4 --continuations 16384 --generation-timeout 60
    left=$((575 - SECONDS))
    [ $left -gt 20 ] && stage eval $left
    summary
    ;;
  target)
    timeout 150 python -m training.run --out /tmp/smoke --work /tmp/smoke_work --device cuda \
      --steps 5 --chat-steps 5 --drafter-steps 5 --max-chars 150000 --chat-max-chars 300000 \
      --layers 4 --hidden 64 --seq-len 64 --batch 4 --block 4 --eval-prompts 2 \
      --continuations 8 --code-max-tokens 16 --ppl-rows 8 > "$out/smoke.log" 2>&1
    echo "smoke rc=$?"; tail -18 "$out/smoke.log" | cut -c1-300
    # The GPU tests share the GPU with the (small) training run meanwhile.
    (timeout 420 python -m pytest tests/test_gpu_ops.py tests/test_gpu_model.py -q \
      -p no:cacheprovider > "$out/gputests.log" 2>&1) &
    stage data 120
    examples & building=$!
    stage target 330 --target-minutes 4.5
    wait $building
    stage chat 100 --chat-minutes 1
    wait
    echo "gpu tests:"; tail -15 "$out/gputests.log" | cut -c1-300
    rm -f "$work/run/rows.pt"  # remade from the corpus in the second call (its data stage)
    tar czf - -C "$work" default_model run chat.jsonl | split -b 15M - "$out/bundle.tgz."
    ;;
  drafter)
    [ -d "$work/run" ] || cp -r .work/bundle/* "$work/"
    stage data 120
    stage drafter 320 --drafter-minutes 2.4 --continuations 16384 --generation-timeout 110
    stage eval $((575 - SECONDS))
    summary
    ;;
  *) echo "usage: $0 all|target|drafter"; exit 2 ;;
esac
