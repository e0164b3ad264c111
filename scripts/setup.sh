#!/usr/bin/env bash
# Create .venv and install eventsched with its test dependencies (idempotent).
set -euo pipefail
cd "$(dirname "$0")/.."

# The venv's interpreter must be one every user of the machine can run (a root
# daemon's users run this CLI): prefer the system's Python over one installed
# under a private home such as /root/.pyenv.
world_runnable() {  # true if "$1" and every folder above it are open to other users
  "$1" - <<'PY' 2>/dev/null
import os, stat, sys
path = os.path.realpath(sys.executable)
while True:
    if not os.stat(path).st_mode & stat.S_IXOTH:
        sys.exit(1)
    if path == "/":
        break
    path = os.path.dirname(path)
PY
}
pick_python() {
  local candidate
  for candidate in ${PYTHON:-} /usr/bin/python3 /usr/local/bin/python3 "$(command -v python3)"; do
    [ -x "$candidate" ] || continue
    "$candidate" -c 'import sys, venv; sys.exit(sys.version_info < (3, 11))' 2>/dev/null || continue
    if [ -n "${PYTHON:-}" ] || world_runnable "$candidate"; then echo "$candidate"; return; fi
  done
  command -v python3
}

if [ -x .venv/bin/python ] && ! world_runnable .venv/bin/python; then
  echo "setup: .venv's interpreter cannot be run by other users; rebuilding it" >&2
  rm -rf .venv
fi
if [ ! -x .venv/bin/python ]; then
  "$(pick_python)" -m venv .venv
fi
log=$(mktemp)
# quiet unless something fails: then the whole pip output is shown. The
# compat editable mode (a .pth path entry, no import hook) keeps every CLI
# call's start-up ~10 ms shorter than setuptools' default editable finder.
if ! { .venv/bin/python -m pip install --upgrade pip && .venv/bin/python -m pip install -e '.[test,ray]' --config-settings editable_mode=compat; } >"$log" 2>&1; then
  cat "$log" >&2
  rm -f "$log"
  echo "setup: installing eventsched failed (output above)" >&2
  exit 1
fi
rm -f "$log"
