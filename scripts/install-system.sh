#!/usr/bin/env bash
# Machine-wide install (run as root): a venv every user can run, the
# `eventsched` command on every user's PATH, the systemd unit and the socket
# location for every login shell. See README "A machine-wide install".
#
#   sudo scripts/install-system.sh            # /opt/eventsched, /usr/local/bin/eventsched
#   PREFIX=/tmp/x scripts/install-system.sh   # somewhere else (no systemd unit, no profile)
set -euo pipefail
cd "$(dirname "$0")/.."
PREFIX="${PREFIX:-}"
VENV="${PREFIX:-/opt}/eventsched"
[ -n "$PREFIX" ] && VENV="$PREFIX/lib/eventsched"
BIN="${PREFIX:-/usr/local}/bin"
umask 022  # everything installed is readable by all, writable by root alone

python=""
for candidate in ${PYTHON:-} /usr/bin/python3 /usr/local/bin/python3; do
  if [ -x "$candidate" ] && "$candidate" -c 'import sys, venv; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
    python=$candidate; break
  fi
done
if [ -z "$python" ]; then
  echo "install-system: need a system Python >= 3.11 with venv (apt-get install python3 python3-venv)" >&2
  exit 1
fi

log=$(mktemp)
if ! { "$python" -m venv "$VENV" && "$VENV/bin/python" -m pip install --upgrade pip \
       && "$VENV/bin/python" -m pip install "$PWD"; } >"$log" 2>&1; then
  cat "$log" >&2; rm -f "$log"
  echo "install-system: installing into $VENV failed (output above)" >&2
  exit 1
fi
rm -f "$log"
mkdir -p "$BIN"
ln -sf "$VENV/bin/eventsched" "$BIN/eventsched"

if [ -z "$PREFIX" ]; then
  install -m 644 contrib/eventsched.service /etc/systemd/system/eventsched.service
  # every user's CLI finds the machine's daemon
  echo 'export EVENTSCHED_SOCKET=/run/eventsched/eventsched.sock' > /etc/profile.d/eventsched.sh
  chmod 644 /etc/profile.d/eventsched.sh
  if command -v systemctl >/dev/null && [ -d /run/systemd/system ]; then
    systemctl daemon-reload
    echo "installed; start it with: systemctl enable --now eventsched"
  else
    echo "installed; no systemd here: run 'eventsched serve --state-dir /var/lib/eventsched --socket /run/eventsched/eventsched.sock' as root"
  fi
else
  echo "installed $BIN/eventsched -> $VENV"
fi
