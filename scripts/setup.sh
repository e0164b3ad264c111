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

# The JupyterLab sidebar: TypeScript built with JupyterLab's own builder into a
# prebuilt labextension copied into the venv, and the server extension enabled
# there. The build is skipped while its output is newer than every source.
build_labextension() {
  local out=labextension/build/eventsched-jupyterlab dest=.venv/share/jupyter/labextensions/eventsched-jupyterlab
  mkdir -p .venv/etc/jupyter/jupyter_server_config.d
  cp labextension/jupyter-config/jupyter_server_config.d/eventsched.json .venv/etc/jupyter/jupyter_server_config.d/
  if ! command -v node >/dev/null; then
    echo "setup: warning: node is not installed, so the JupyterLab sidebar is not built (apt-get install nodejs)" >&2
    return 0
  fi
  if [ ! -f "$out/package.json" ] || [ -n "$(find labextension/src labextension/style labextension/package.json \
       labextension/tsconfig.json labextension/yarn.lock -newer "$out/package.json" -print -quit)" ]; then
    local core log
    core=$(.venv/bin/python -c 'import jupyterlab, os; print(os.path.join(os.path.dirname(jupyterlab.__file__), "staging"))')
    log=$(mktemp)
    if ! (cd labextension && ../.venv/bin/jlpm install && ../.venv/bin/jlpm tsc \
          && node node_modules/@jupyterlab/builder/lib/build-labextension.js --core-path "$core" .) >"$log" 2>&1; then
      cat "$log" >&2
      rm -f "$log"
      echo "setup: building the JupyterLab sidebar failed (output above)" >&2
      return 1
    fi
    rm -f "$log"
  fi
  rm -rf "$dest" && mkdir -p "$(dirname "$dest")" && cp -r "$out" "$dest"
}

if [ -x .venv/bin/python ] && ! world_runnable .venv/bin/python; then
  echo "setup: .venv's interpreter cannot be run by other users; rebuilding it" >&2
  rm -rf .venv
fi
if [ ! -x .venv/bin/python ]; then
  "$(pick_python)" -m venv .venv
fi
# What the install depends on: the dependencies, the build, and the sources
# that mypyc compiles in place (setup.py). Unchanged since the last install:
# nothing to do (the compile takes minutes).
stamp=.venv/.eventsched-install
want=$(cat pyproject.toml setup.py eventsched/_compiled.py eventsched/runtime/launch/_spawn.c eventsched/projections/_frames.c $(sed -n 's/^    "\(eventsched\/.*\.py\)",$/\1/p' eventsched/_compiled.py) \
       | sha256sum | cut -d' ' -f1)
# bytecode for every module: CLI calls start faster, even where
# PYTHONDONTWRITEBYTECODE keeps Python from writing it
.venv/bin/python -m compileall -q eventsched >/dev/null
# (a compiled module older than its source, as after a checkout that rewrote
# the file unchanged, is rebuilt too: until then every process runs the sources)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] \
   && .venv/bin/python -c 'import sys; from eventsched import _compiled; sys.exit(bool(_compiled.stale()))' 2>/dev/null; then
  build_labextension
  exit 0
fi
# a module no longer compiled: its old extension would shadow the source
for orphan in $(.venv/bin/python -c 'from eventsched import _compiled; print(" ".join(_compiled.orphans()))' 2>/dev/null || true); do
  rm -f -- "$orphan"
done
log=$(mktemp)
# quiet unless something fails: then the whole pip output is shown. The
# compat editable mode (a .pth path entry, no import hook) keeps every CLI
# call's start-up shorter than setuptools' default editable finder does;
# it builds the compiled modules in place, beside their sources.
if ! { .venv/bin/python -m pip install --upgrade pip && .venv/bin/python -m pip install -e '.[test,ray,mcp]' --config-settings editable_mode=compat; } >"$log" 2>&1; then
  cat "$log" >&2
  rm -f "$log"
  echo "setup: installing eventsched failed (output above)" >&2
  exit 1
fi
if [ -z "${EVENTSCHED_PURE:-}" ] && ! .venv/bin/python -c \
    'import sys, eventsched.core; from eventsched import _compiled; sys.exit(not _compiled.compiled())'; then
  echo "setup: the hot path could not be compiled (no C compiler or Python headers?); it runs as Python, slower" >&2
fi
rm -f "$log"
echo "$want" > "$stamp"
build_labextension
