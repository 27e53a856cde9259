#!/usr/bin/env bash
# The quick start: build (once, cached) a small trained target + MoA drafter widened into a pair
# of realistic cost (vllm_moa/demo.py), serve the target twice with `vllm serve` (plain, and
# with `--speculative-config '{"method": "moa", ...}'`), send both the same greedy requests with
# the openai client and print the outputs side by side, tokens/s, tau and the speed-up
# (examples/compare_servers.py; a JSON and a plot in $VLLM_MOA_CACHE/demo-results/).
# `vllm-moa demo` is the standalone-engine version. Extra arguments go to compare_servers.py.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PORT=${PORT:-8000}            # MoA; plain on PORT+1
# the paths are the last two lines of stdout (the first build reports on stderr)
mapfile -t paths < <(.venv/bin/python -c \
  "from vllm_moa.demo import ensure_demo_models; print(*ensure_demo_models(), sep='\n')" | tail -n 2)
if [ "${#paths[@]}" -ne 2 ] || [ ! -d "${paths[0]}" ] || [ ! -d "${paths[1]}" ]; then
  echo "could not build the demo models (see the messages above)" >&2
  exit 1
fi
target=${paths[0]}
drafter=${paths[1]}
out=$(.venv/bin/python -c "from vllm_moa.tiny import default_cache_dir; print(default_cache_dir())")/demo-results
mkdir -p "$out"
servers=()
trap 'for s in "${servers[@]}"; do kill "$s" 2>/dev/null; wait "$s" 2>/dev/null || true; done' EXIT

serve() {  # NAME PORT [vllm serve arguments...]: start a server, wait until it answers
  local name=$1 port=$2 log="$out/serve-$1.log"
  shift 2
  echo "starting vllm serve ($name) on port $port (log: $log) ..."
  VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1} .venv/bin/vllm serve "$target" \
    --served-model-name vllm-moa-demo --port "$port" "$@" >"$log" 2>&1 &
  servers+=($!)
  for _ in $(seq 1 300); do
    if curl -sf "http://127.0.0.1:$port/health" >/dev/null; then return 0; fi
    if ! kill -0 "${servers[-1]}" 2>/dev/null; then
      echo "vllm serve ($name) exited:"; tail -n 40 "$log"; exit 1
    fi
    sleep 1
  done
  echo "vllm serve ($name) did not answer in 300 s: $log" >&2; exit 1
}

# one after the other: two start-ups at once would share this machine's cores
serve moa "$PORT" \
  --speculative-config "{\"method\": \"moa\", \"model\": \"$drafter\", \"num_speculative_tokens\": 4}"
serve plain "$((PORT + 1))"
.venv/bin/python examples/compare_servers.py --moa "http://127.0.0.1:$PORT" \
  --plain "http://127.0.0.1:$((PORT + 1))" --out "$out/demo" "$@"
