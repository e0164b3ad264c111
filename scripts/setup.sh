#!/usr/bin/env bash
# Create .venv and install eventsched with its test dependencies (idempotent).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
log=$(mktemp)
# quiet unless something fails: then the whole pip output is shown. The
# compat editable mode (a .pth path entry, no import hook) keeps every CLI
# call's start-up ~10 ms shorter than setuptools' default editable finder.
if ! { .venv/bin/python -m pip install --upgrade pip && .venv/bin/python -m pip install -e '.[test]' --config-settings editable_mode=compat; } >"$log" 2>&1; then
  cat "$log" >&2
  rm -f "$log"
  echo "setup: installing eventsched failed (output above)" >&2
  exit 1
fi
rm -f "$log"
