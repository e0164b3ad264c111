#!/usr/bin/env bash
# Tools the benchmarks race against (bench/race.sh), not needed by the tests:
# task-spooler (`tsp`), from Debian.
set -euo pipefail
if command -v tsp >/dev/null; then
  echo "tsp is already installed: $(command -v tsp)"
  exit 0
fi
sudo=""
[ "$(id -u)" = 0 ] || sudo=sudo
$sudo apt-get update -qq
$sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq task-spooler >/dev/null
command -v tsp >/dev/null || { echo "install-bench-tools: task-spooler installed no tsp" >&2; exit 1; }
echo "installed $(command -v tsp)"
