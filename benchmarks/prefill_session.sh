#!/usr/bin/env bash
# One device call that measures the prefill scenarios of `headstart bench` through `headstart
# serve`, client-side, at the 2B bf16 and 27B 4-bit shapes (random weights: --load-format dummy,
# so no checkpoint is written). Run from the repository root on the device machine, after
# `bash benchmarks/device_wheels.sh` here and with `.whl` carried:
#   bash benchmarks/prefill_session.sh [2b] [27b]
# Results: /tmp/receipts/<shape>-<scenario>/ (receipts), $OUT/<shape>-serve.log (start-up phases),
# $OUT/<shape>-details.tar.gz (the server's request logs, whose TTFTs each table is followed by,
# the timelines, and each receipt's requests.json),
# and every scenario's table on stdout, with the client's decode time per token. SCENARIOS="burst long,--prompt-tokens,500" picks
# scenarios, each with its bench options after commas (default: burst long turn beside); RESTART=1 then starts the server a second time on the same machine (Triton's and
# FLA's caches warm), logs that start in $OUT/<shape>-restart.log and runs RESTART_SCENARIOS
# on it; SERVE_FLAGS adds serve flags (RESTART_FLAGS instead, for the restart); TIMELINE=1
# runs the server through benchmarks/request_timeline.py and prints each scenario's timeline
# (for bursts also one line a burst, from the client's first send: when its bodies were read,
# submitted, admitted, answered on the server, and the client's last first token).
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD/src:$PWD PYTHONUNBUFFERED=1
out=${OUT:-/tmp}
receipts=/tmp/receipts  # many files: only the logs and the tables go to $OUT
mkdir -p "$receipts"
shapes=${*:-2b 27b}
port=18888
server=
stop() { [ -n "$server" ] && kill -- "-$server" 2>/dev/null; wait 2>/dev/null; server=; }
trap stop EXIT

# Start `serve` for shape $1 on a new port, logging to $2; wait until it answers; print phases.
start_server() {
  port=$((port + 1))
  local cmd=(-m headstart)  # TIMELINE=1: through benchmarks/request_timeline.py
  [ -n "${TIMELINE:-}" ] && cmd=(benchmarks/request_timeline.py --timeline "$2.timeline")
  setsid python3 "${cmd[@]}" serve "/tmp/m-$1" --load-format dummy --port "$port" \
    --context 16384 --parallel 16 --request-log "$2.requests" ${SERVE_FLAGS:-} >"$2" 2>&1 &
  log=$2 seen=0
  server=$!
  python3 - "$port" "$server" <<'EOF' || { tail -20 "$2"; stop; return 1; }
import sys, time, urllib.request
deadline = time.time() + 400
while time.time() < deadline:
    try:  # the server died (say, out of memory; a zombie until the shell waits): stop waiting
        if open(f"/proc/{sys.argv[2]}/stat").read().rsplit(")", 1)[1].split()[0] == "Z":
            sys.exit(1)
    except FileNotFoundError:
        sys.exit(1)
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/v1/models", timeout=2)
        sys.exit(0)
    except Exception:
        time.sleep(1)
sys.exit(1)
EOF
  grep -E "step budget|ready in|loaded|dense|captured;| in [0-9.]+s" "$2" | cut -c25-
}

# The server's own TTFT (its request log, past line $2) beside the client's: what HTTP and the
# client add to it.
server_ttft() {
  python3 - "$1" "${2:-0}" <<'EOF'
import json, statistics, sys
try:
    rows = [json.loads(l) for l in open(sys.argv[1]).readlines()[int(sys.argv[2]):]]
except OSError:
    sys.exit(0)
ttft = sorted(1e3 * r["ttft_s"] for r in rows if r.get("ttft_s") is not None)
if ttft:
    print(f"server-side ttft ms over {len(ttft)} requests: median {statistics.median(ttft):.1f}, "
          f"max {ttft[-1]:.1f}")
EOF
}

# The client's decode time per token (median over the receipt $1's requests that decoded):
# beside a short prompt's TTFT, the decode step the issue's targets are counted in; and its
# TTFT split at the response's headers.
client_decode() {
  python3 - "$1/requests.json" <<'EOF'
import json, statistics, sys
try:
    d = json.load(open(sys.argv[1]))
except OSError:
    sys.exit(0)
rows = [dict(zip(d["fields"], r)) if isinstance(r, list) else r for r in d["requests"]]
ms = [1e3 / r["decode_tok_s"] for r in rows if r.get("decode_tok_s")]
if ms:
    print(f"client decode: median {statistics.median(ms):.2f} ms a token over {len(ms)} requests")
# Where the client's TTFT went: to the response's headers (the request's way in), then to the
# first token (its way out); the median, and the request with the slowest first token.
split = [(1e3 * (r["t_head"] - r["t_send"]), 1e3 * (r["t_first"] - r["t_head"]))
         for r in rows if r.get("t_head") is not None and r.get("t_first") is not None]
if split:
    ins, outs = zip(*split)
    slow = max(split, key=sum)
    print(f"client ttft split: headers {statistics.median(ins):.1f} ms after the send, first token "
          f"{statistics.median(outs):.1f} ms after them (medians); slowest: {slow[0]:.1f} + {slow[1]:.1f}")
EOF
}

# Run each scenario (name,opt,value,...) against the server on $port, print its table.
run_scenarios() {
  for sc in "$@"; do
    name=${sc%%,*}
    extra=${sc#"$name"}
    runs=$((${runs:-0} + 1))  # a scenario may run twice in one session: each its own receipt
    tag=$(echo "$sc" | tr -c 'a-z0-9\n' '-')-$runs
    timeout 240 python3 -m headstart bench --arm "headstart=http://127.0.0.1:$port" --orders 1 \
      --scenario "$name" ${extra//,/ } --out "$receipts/$shape-$tag" --no-progress \
      >"$receipts/$shape-$tag.log" 2>&1
    echo "== $shape $sc (rc $?)"
    grep -v -E "^(bench check|receipt|---)" "$receipts/$shape-$tag.log" | tail -"${TAIL:-14}"
    server_ttft "$log.requests" "$seen"
    client_decode "$receipts/$shape-$tag"
    if [ -n "${TIMELINE:-}" ]; then
      sleep 2.5  # the timeline file is rewritten every 2 s
      python3 benchmarks/request_timeline.py --show "$log.timeline" "$((seen + 1))" | tail -"${TAIL:-14}"
      # A burst's phases, one line a burst (every burst the server has seen so far).
      # Counted from the client's sends (this scenario's receipt: its bursts; earlier ones nan).
      [ "$name" = burst ] && python3 benchmarks/request_timeline.py --bursts "$log.timeline" 16 \
        --receipt "$receipts/$shape-$tag"
    fi
    seen=$(wc -l <"$log.requests" 2>/dev/null || echo 0)
  done
}

for shape in $shapes; do
  fmt=bf16
  [ "$shape" = 27b ] && fmt=4bit
  python3 benchmarks/make_random_checkpoint.py --shape "$shape" --format "$fmt" --config-only \
    --out "/tmp/m-$shape" >/dev/null
  start_server "$shape" "$out/$shape-serve.log" || continue
  # burst first: its first burst is the server's first after start-up.
  run_scenarios ${SCENARIOS:-burst long turn beside}
  stop
  grep -h "drained" "$out/$shape-serve.log" | cut -c25-  # the GPU memory the run peaked at
  if [ -n "${RESTART:-}" ]; then
    echo "== $shape restart"
    SERVE_FLAGS="${RESTART_FLAGS:-${SERVE_FLAGS:-}}" start_server "$shape" "$out/$shape-restart.log" \
      && run_scenarios ${RESTART_SCENARIOS:-}
    stop
  fi
  # The device returns only a few files a call: one archive a shape holds the request logs,
  # the timelines and each scenario's per-request receipt (every token's arrival time).
  (cd "$out" && tar czf "$shape-details.tar.gz" --remove-files "$shape"-*.requests \
    $(ls "$shape"-*.timeline* 2>/dev/null) \
    -C "$receipts" $(cd "$receipts" && ls -d "$shape"-*/requests.json 2>/dev/null)) 2>/dev/null
done
