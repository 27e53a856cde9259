#!/usr/bin/env bash
# Every GPU measurement the project still owes (issues 3 and 5), in as few device calls as the
# device tool's limits allow (10 min per call, 30 min per session, a bare machine that stays
# warm only while calls follow each other): torch/triton/transformers come with the machine;
# nothing here needs vLLM or an install (the scripts map kernels/ as vllm_moa.kernels).
#
#   call 1:  bash scripts/gpu_session.sh measure
#            the kernel tests (compiled), kernels_gpu.py (correctness + timing) and the
#            Llama-3-8B cost model, one after the other on an idle GPU, then starts the `gpu`
#            testbed in the background (setsid);
#   call 2+: bash scripts/gpu_session.sh wait [SECONDS]   (`start`: the background testbed alone)
#            waits for the testbed (default 540 s), then copies what it has (the results JSON is
#            rewritten after each drafter's evaluation, "complete": false until the end).
#
# Results go to $OUT (the device tool's folder) or benchmarks/results/. The testbed's held-out
# prompts must travel with the call: copy ../shared/data/HumanEval.jsonl.gz to .device/ (ignored
# by git) and name .device in the call's `carry`; PROMPTS overrides the path.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
out=${OUT:-benchmarks/results}
work=.gpu-session  # machine-local: the testbed's cached stages, its log and exit status
prompts=${PROMPTS:-.device/HumanEval.jsonl.gz}
preset=${PRESET:-gpu}  # PRESET=ci to try the background run on any machine
mkdir -p "$out" "$work"

start_testbed() {
  if [ ! -f "$prompts" ]; then
    echo "no prompts at $prompts: copy ../shared/data/HumanEval.jsonl.gz to .device/ and carry" \
      ".device (or set PROMPTS)" >&2
    return 1
  fi
  rm -f "$work/testbed.rc"
  setsid bash -c "$PY -m benchmarks.testbed --preset $preset --prompts '$prompts' \
      --out '$work/testbed' --results '$work/testbed_$preset.json' --tree 6 8 62 \
      > '$work/testbed.log' 2>&1; echo \$? > '$work/testbed.rc'" > /dev/null 2>&1 < /dev/null &
  echo "testbed started in the background (log: $work/testbed.log)"
}

case "${1:-}" in
  measure)
    {
      nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv || true
      $PY -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, \
transformers.__version__)"
      # the kernel tests compiled on the GPU (fresh random inputs at the suite's shapes), the
      # kernels' correctness and timing at 8B shapes, then the cost model (taus: the cpu testbed's
      # slim run; re-project with other taus later: python -m benchmarks.cost_model --reproject)
      timeout 180 $PY -m pytest -q -p no:cacheprovider tests/test_kernels.py || echo "tests: exit $?"
      timeout 240 $PY benchmarks/kernels_gpu.py --out "$out/kernels_h200.json" || echo "kernels: exit $?"
      timeout 300 $PY -m benchmarks.cost_model --out "$out/cost_model_h200.json" \
        --tau benchmarks/results/testbed_cpu_slim.json || echo "cost model: exit $?"
      start_testbed
    } 2>&1 | tee "$out/measure.log"
    ;;
  start)  # the background testbed alone
    start_testbed
    ;;
  wait)
    limit=${2:-540}
    waited=0
    while [ ! -f "$work/testbed.rc" ] && [ "$waited" -lt "$limit" ]; do
      sleep 10
      waited=$((waited + 10))
    done
    tr '\r' '\n' < "$work/testbed.log" | grep -v '^\s*$' | tail -n 400 > "$out/testbed.log" || true
    tail -n 5 "$out/testbed.log" || true
    cp "$work/testbed_$preset.json" "$work/testbed_$preset.png" "$out"/ 2>/dev/null || true
    if [ -f "$work/testbed.rc" ]; then
      echo "testbed finished: exit $(cat "$work/testbed.rc")"
    else
      echo "testbed still running after ${waited}s: call wait again"
    fi
    ;;
  *)
    echo "usage: bash scripts/gpu_session.sh measure | start | wait [SECONDS]" >&2
    exit 2
    ;;
esac
