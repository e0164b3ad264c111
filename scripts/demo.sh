#!/usr/bin/env bash
# The scheduler's main job, end to end: set up, start a daemon (on fake GPUs
# when there is no NVIDIA driver), submit a mix of jobs from the CLI, watch them
# share the GPUs, then show the queue, the history in SQL and stop the daemon.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
ES=.venv/bin/eventsched
export EVENTSCHED_STATE_DIR="${EVENTSCHED_STATE_DIR:-$(mktemp -d /tmp/eventsched-demo.XXXXXX)}"
GPUS="fake:4:24576"
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then GPUS=""; fi
echo "== state directory: $EVENTSCHED_STATE_DIR   gpus: ${GPUS:-NVML}"
$ES serve ${GPUS:+--gpus "$GPUS"} --sample-interval 0.5 2>"$EVENTSCHED_STATE_DIR/daemon.log" &
DAEMON=$!
trap 'kill $DAEMON 2>/dev/null; wait $DAEMON 2>/dev/null || true' EXIT
for _ in $(seq 100); do $ES health >/dev/null 2>&1 && break; sleep 0.1; done
$ES health

echo "== submitting: four half-GPU jobs, a 2-GPU gang job, a pinned job, a high-priority job"
for i in 1 2 3 4; do
  $ES submit --gpus 0.5 --name "half-$i" -- sh -c 'echo "half job on GPU $CUDA_VISIBLE_DEVICES"; sleep 2' >/dev/null
done
$ES submit --gpus 2 --name gang -- sh -c 'echo "gang job on GPUs $CUDA_VISIBLE_DEVICES"; sleep 2' >/dev/null
$ES submit --gpus 1 --gpu-ids 3 --name pinned -- sh -c 'echo "pinned to $CUDA_VISIBLE_DEVICES"; sleep 1' >/dev/null
URGENT=$($ES submit --gpus 1 --priority 10 --name urgent -- sh -c 'echo "urgent on $CUDA_VISIBLE_DEVICES"')
sleep 0.5
echo "== status"
$ES status
echo "== queue"
$ES queue
echo "== why is job $URGENT waiting?"
$ES explain "$URGENT" || true
echo "== waiting for every job to finish"
for _ in $(seq 200); do
  [ -z "$($ES queue --json | .venv/bin/python -c 'import json,sys; print("x" if json.load(sys.stdin) else "")')" ] && break
  sleep 0.2
done
$ES queue --all
echo "== output of job $URGENT"
$ES logs "$URGENT"
echo "== the log is the truth: $($ES log dump "$EVENTSCHED_STATE_DIR/log" | wc -l) events"
$ES log verify "$EVENTSCHED_STATE_DIR/log"
if $ES sql "SELECT 1" >/dev/null 2>&1; then
  echo "== history in SQL"
  $ES sql "SELECT user, count(*) AS jobs, round(sum(wait_s), 2) AS total_wait_s FROM jobs GROUP BY user"
fi
