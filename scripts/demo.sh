#!/usr/bin/env bash
# The quick start: build (once, cached) a tiny target + a trained MoA drafter, serve them with
# `vllm serve ... --speculative-config '{"method": "moa", ...}'`, and query the server with the
# openai client (examples/openai_client.py). `vllm-moa demo` is the standalone-engine version.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PORT=${PORT:-8000}
# the paths are the last two lines of stdout (the first build reports on stderr)
mapfile -t paths < <(.venv/bin/python -c \
  "from vllm_moa.demo import ensure_demo_models; print(*ensure_demo_models(), sep='\n')" | tail -n 2)
if [ "${#paths[@]}" -ne 2 ] || [ ! -d "${paths[0]}" ] || [ ! -d "${paths[1]}" ]; then
  echo "could not build the demo models (see the messages above)" >&2
  exit 1
fi
target=${paths[0]}
drafter=${paths[1]}
log=$(mktemp -t vllm-moa-serve.XXXXXX.log)
echo "starting vllm serve on port $PORT (log: $log) ..."
VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1} .venv/bin/vllm serve "$target" \
  --served-model-name vllm-moa-demo --port "$PORT" \
  --speculative-config "{\"method\": \"moa\", \"model\": \"$drafter\", \"num_speculative_tokens\": 4}" \
  >"$log" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null; wait $server 2>/dev/null || true' EXIT
for _ in $(seq 1 180); do
  if curl -sf "http://127.0.0.1:$PORT/health" >/dev/null; then break; fi
  if ! kill -0 $server 2>/dev/null; then echo "vllm serve exited:"; tail -n 40 "$log"; exit 1; fi
  sleep 1
done
.venv/bin/python examples/openai_client.py --base-url "http://127.0.0.1:$PORT" "$@"
