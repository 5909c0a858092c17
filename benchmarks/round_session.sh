#!/usr/bin/env bash
# One device call for the default model's speculative rounds: the window and round GPU tests,
# then (not beside them) profile_round.py and whole_rounds.py on this tree and on BASE (a commit, default HEAD~1,
# checked out beside it), each in its own process. Run from the repository root on the device,
# with `.whl` (benchmarks/device_wheels.sh) and `.work` (CORPUS: a `training.data --tar`
# tarball, default .work/corpus.tgz) carried:
#   BASE=<commit> [BASE_DIR=DIR] ROWS=chain:whole,auto:whole bash benchmarks/round_session.sh
# Results under $OUT: tests.log, profile-{new,base}.log, rounds-{new,base}.log.
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
out=${OUT:-/tmp}
base=${BASE:-HEAD~1}
base_dir=/tmp/base
mkdir -p /tmp/corpus && tar xzf "${CORPUS:-.work/corpus.tgz}" -C /tmp/corpus
# The base tree: BASE_DIR (a carried copy, e.g. `git archive BASE src benchmarks training`), or
# a worktree of BASE where the repository travelled with its history.
if [ -n "${BASE_DIR:-}" ]; then
  base_dir=$BASE_DIR
else
  git worktree add -f /tmp/base "$base" >/dev/null 2>&1 || echo "no base tree: $base"
fi
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
if [ -z "${SKIP_TESTS:-}" ]; then
  PYTHONPATH=/tmp/site:$PWD/src:$PWD timeout "${TESTS_TIMEOUT:-300}" python -m pytest -q \
    -p no:cacheprovider tests/test_fused_ops.py tests/test_gpu_model.py \
    -k "window or round or verify or conv_step or gdn_decode or graph_replay" \
    >"$out/tests.log" 2>&1  # before the timings, not beside them
fi
for tree in new base; do
  dir=$PWD
  [ "$tree" = base ] && dir=$base_dir
  [ -d "$dir/src" ] || continue
  (
    cd "$dir" || exit
    export PYTHONPATH=/tmp/site:$dir/src:$dir PYTHONUNBUFFERED=1
    timeout 150 python benchmarks/profile_round.py --top 40 >"$out/profile-$tree.log" 2>&1 \
      || python "$OLDPWD/benchmarks/profile_round.py" --top 40 >"$out/profile-$tree.log" 2>&1
    timeout 240 python benchmarks/whole_rounds.py --corpus /tmp/corpus/corpus \
      --rows "${ROWS:-chain:whole,auto:whole}" >"$out/rounds-$tree.log" 2>&1
  )
done
tail -3 "$out/tests.log" 2>/dev/null
for tree in new base; do
  echo "== $tree"
  grep -E "^\|" "$out/profile-$tree.log" "$out/rounds-$tree.log" 2>/dev/null | cut -d: -f2-
done
