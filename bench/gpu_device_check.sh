#!/usr/bin/env bash
# What only a real NVIDIA GPU can show; run by hand on a machine with one (CI
# has none, and every test uses fake GPUs behind the same interface):
#   1. the NVML backend against the real driver: discovery and one sample;
#   2. a job that really allocates GPU memory under CUDA_VISIBLE_DEVICES: the
#      samples attribute that memory to the job, not to a foreign process;
#   3. two half-GPU jobs on one card: each one's memory is its own;
#   4. a process outside eventsched holding most of the card: its memory is
#      foreign, and a job whose --gpu-mem does not fit beside it waits (explain
#      says why), then runs once the process is gone;
#   5. a job over its --gpu-mem under gpu_mem_policy = "stop" ends failed.
# Needs a python3 with torch (to allocate), msgspec, duckdb, anyio and
# nvidia-ml-py. Writes its evidence to $OUT (default: a temporary folder).
# GPUS=fake:1 runs the plumbing on fake GPUs (the jobs then fail without torch).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=$(command -v "${PY:-python3}")
OUT=${OUT:-$(mktemp -d /tmp/gpu-check-out.XXXXXX)}
mkdir -p "$OUT"
S=$(mktemp -d /tmp/es-gpu.XXXXXX)
export EVENTSCHED_STATE_DIR=$S
es() { "$PY" -m eventsched.cli "$@"; }
step() { echo; echo "== $(date +%T) $*"; }

# hold N GiB on the job's first visible GPU for S seconds, and say where it is
ALLOC='import os, sys, time, torch
n, hold = int(sys.argv[1]), float(sys.argv[2])
x = torch.empty(n << 30, dtype=torch.uint8, device="cuda"); x.fill_(1); torch.cuda.synchronize()
visible = os.environ.get("CUDA_VISIBLE_DEVICES")
print(f"CUDA_VISIBLE_DEVICES={visible} devices={torch.cuda.device_count()} "
      f"{torch.cuda.get_device_name(0)} holding {n} GiB", flush=True)
time.sleep(hold)'

wait_done() {  # wait_done JOB SECONDS: until the job has ended
  local i
  for i in $(seq $(($2 * 5))); do
    state=$(es queue --all --json | "$PY" -c "import json,sys; print(next((j['state'] for j in json.load(sys.stdin) if j['id']==$1), '?'))")
    case $state in succeeded|failed|cancelled|lost) echo "job $1: $state"; return 0;; esac
    sleep 0.2
  done
  echo "job $1: still $state after $2 s"
}

step "the driver"
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv

step "1. NVML backend: discovery and one sample"
"$PY" - <<'EOF'
from eventsched.runtime.gpus import NvmlBackend
backend = NvmlBackend()
for info in backend.discover():
    print(info)
for sample in backend.sample():
    print(sample)
backend.close()
EOF

cat >"$S/config.toml" <<'EOF'
sample_interval_s = 0.5
[scheduler]
gpu_mem_policy = "stop"
kill_grace_s = 2.0
EOF
step "daemon on NVML (no --gpus)"
# the daemon itself in the background (not a subshell running `es`), so the
# EXIT trap's kill reaches it; its stdout is closed so a pipe after this
# script (| tee) ends with the script
"$PY" -m eventsched.cli serve ${GPUS:+--gpus "$GPUS"} --config "$S/config.toml" >/dev/null 2>"$S/daemon.log" &
DAEMON=$!
trap 'kill $DAEMON 2>/dev/null; wait $DAEMON 2>/dev/null; cp "$S/daemon.log" "$OUT/" 2>/dev/null' EXIT
for _ in $(seq 100); do es health >/dev/null 2>&1 && break; sleep 0.1; done
es health
es status

step "2. a job holding 20 GiB for 12 s"
A=$(es submit --gpus 1 --name alloc20 -- "$PY" -c "$ALLOC" 20 12)
sleep 9
es status
wait_done "$A" 40
es logs "$A"

step "3. two half-GPU jobs, 6 and 9 GiB, at once"
B1=$(es submit --gpus 0.5 --name half6 -- "$PY" -c "$ALLOC" 6 10)
B2=$(es submit --gpus 0.5 --name half9 -- "$PY" -c "$ALLOC" 9 10)
sleep 8
es status
wait_done "$B1" 40; wait_done "$B2" 40
es logs "$B1"; es logs "$B2"

step "4. a foreign process holding most of the card"
TOTAL_GIB=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1 | awk '{print int($1/1024)}')
FOREIGN_GIB=$((TOTAL_GIB * 3 / 4))
"$PY" -c "$ALLOC" "$FOREIGN_GIB" 60 &
FOREIGN=$!
sleep 10
WANT_MIB=$(( (TOTAL_GIB - FOREIGN_GIB + 8) * 1024 ))  # more than is left beside it
C=$(es submit --gpus 1 --gpu-mem "$WANT_MIB" --name wont-fit -- "$PY" -c "$ALLOC" 1 2)
sleep 2
es status
es explain "$C"
kill "$FOREIGN"; wait "$FOREIGN" 2>/dev/null
echo "foreign process ended"
wait_done "$C" 60
es explain "$C" | tail -8

step "5. a job over its --gpu-mem (asks 4000 MiB, holds 10 GiB) under gpu_mem_policy = stop"
D=$(es submit --gpus 1 --gpu-mem 4000 --name over -- "$PY" -c "$ALLOC" 10 60)
wait_done "$D" 60
es explain "$D" | tail -8

step "the record"
es queue --all
es log verify "$S/log"
es log dump "$S/log" >"$OUT/events.txt"
echo "samples with job memory (job -> MiB), the largest per job:"
"$PY" - "$OUT/events.txt" <<'EOF'
import re, sys
most: dict[str, int] = {}
foreign_max = 0
for line in open(sys.argv[1]):
    if " GpuSampled " not in line:
        continue
    for job, mib in re.findall(r'"(\d+)":(\d+)', line.split("job_memory_mib=")[1].split(" foreign_processes=")[0]):
        most[job] = max(most.get(job, 0), int(mib))
    foreign_max = max(foreign_max, int(re.search(r"foreign_memory_mib=(-?\d+)", line).group(1)))
print({int(k): v for k, v in sorted(most.items(), key=lambda kv: int(kv[0]))}, "largest foreign MiB:", foreign_max)
EOF
grep -E "JobGpuMemoryExceeded|JobGpuMemoryWithin" "$OUT/events.txt" | head -5
es sql "SELECT gpu, count(*) AS samples, max(memory_used_mib) AS max_used_mib, max(foreign_memory_mib) AS max_foreign_mib, max(utilization) AS max_util, max(power_w) AS max_power_w FROM gpu_samples GROUP BY gpu"
es sql "SELECT * FROM gpu_memory_overruns"
