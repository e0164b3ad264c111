#!/usr/bin/env bash
# Set up everything the tests need, then run them. Extra arguments go to pytest,
# e.g. `scripts/test.sh -m "not slow"` for the quick ones alone.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
# The browser tests drive Debian's chromium (never a downloaded browser);
# the terminal-session tests Debian's tmux and screen; the Prometheus check
# promtool, from Debian's prometheus package; the clock tests libfaketime.
if { [ ! -x /usr/bin/chromium ] || ! command -v tmux >/dev/null || ! command -v screen >/dev/null \
     || ! command -v promtool >/dev/null || ! command -v faketime >/dev/null; } \
    && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium tmux screen prometheus faketime >/dev/null) \
    || echo "warning: could not install chromium, tmux, screen, prometheus or faketime; their tests will be skipped" >&2
fi
# The multi-user tests (as root) run this checkout's .venv as other users, who must be
# able to pass through every folder above it: one that forbids it (mktemp -d makes
# them 0700) gets o+x, passing through and not listing, for the run, taken back after.
opened=()
if [ "$(id -u)" = 0 ]; then
  dir=$PWD
  while [ "$dir" != / ]; do
    if (( ! (8#$(stat -c %a "$dir") & 1) )) && chmod o+x "$dir"; then opened+=("$dir"); fi
    dir=$(dirname "$dir")
  done
  if (( ${#opened[@]} )); then
    echo "test.sh: other users may pass through ${opened[*]} until the tests end" >&2
    trap 'chmod o-x "${opened[@]}"' EXIT
  fi
fi
# Two workers, a test file to each at a time (a file's tests share its daemon):
# most tests wait on daemons and processes, so one worker leaves a core idle.
# EVENTSCHED_TEST_WORKERS=0 runs them in this one process.
.venv/bin/python -m pytest -n "${EVENTSCHED_TEST_WORKERS:-2}" --dist loadfile "$@"
