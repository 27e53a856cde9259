#!/usr/bin/env bash
# pytest with the given arguments, in .venv (or $PYTHON), from the repository root. If pytest
# itself dies (a crash in native code ends it with no summary: an illegal instruction, an abort),
# the test that was running is named on stderr (tests/current_test.py records each test's id
# before it runs; pytest's faulthandler prints the stacks). The exit code is pytest's.
set -uo pipefail
cd "$(dirname "$0")/.."
current=$(mktemp)
trap 'rm -f "$current"' EXIT
VLLM_MOA_TEST_CURRENT="$current" "${PYTHON:-.venv/bin/python}" -m pytest -p tests.current_test "$@"
rc=$?
if [ "$rc" -gt 128 ]; then
  echo "scripts/run_pytest.sh: pytest died of signal $((rc - 128)) with no summary, while" \
    "running: $(cat "$current")" >&2
fi
exit "$rc"
