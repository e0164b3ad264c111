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
# able to read the checkout and pass through every folder above it: one that forbids it
# (mktemp -d makes them 0700) gets o+rx (the checkout) or o+x (passing through, not
# listing) for the run, and its own mode back after.
restore=()
if [ "$(id -u)" = 0 ]; then
  dir=$PWD need=5
  while [ "$dir" != / ]; do
    mode=$(stat -c %a "$dir")
    if (( (8#$mode & need) != need )) && chmod "o+$( ((need == 5)) && echo rx || echo x)" "$dir"; then
      restore+=("$mode" "$dir")
    fi
    dir=$(dirname "$dir") need=1
  done
  if (( ${#restore[@]} )); then
    echo "test.sh: other users may read this checkout and pass through the folders above it until the tests end" >&2
    trap 'for ((i = 0; i < ${#restore[@]}; i += 2)); do chmod "${restore[i]}" "${restore[i + 1]}"; done' EXIT
  fi
fi
# Two workers, a test file to each at a time (a file's tests share its daemon):
# most tests wait on daemons and processes, so one worker leaves a core idle.
# EVENTSCHED_TEST_WORKERS=0 runs them in this one process.
.venv/bin/python -m pytest -n "${EVENTSCHED_TEST_WORKERS:-2}" --dist loadfile "$@"
