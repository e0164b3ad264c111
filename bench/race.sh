#!/usr/bin/env bash
# The race: one workload, 1,000 jobs of `true` at most 4 at a time, through
#   - xargs -P 4                    (the floor: no scheduler at all)
#   - task-spooler (tsp -S 4)       one `tsp true` per job from a bash loop (skipped if tsp is absent;
#                                   scripts/install-bench-tools.sh installs it)
#   - eventsched, three ways, on `serve --gpus fake:4` with `--gpus 1` jobs (4 fake GPUs: 4 at a time):
#       a bash loop of `eventsched submit --gpus 1 -- true`,
#       one `eventsched submit --gpus 1 --array 0-999 -- true`,
#       one `eventsched submit-file FILE` (1,000 lines of the seeds' format; each line runs
#       `python -u SCRIPT --cuda IDS`, and for the jobs `python` is /bin/true, first on their PATH,
#       so that the workload stays `true`: a Python start per job would be the jobs' cost, not ours).
# Each drain is timed from just before the first submission to the last job's end (eventsched:
# `ended_at` read back from `queue --all --json`; tsp: `tsp -w` on its last job; xargs: its exit),
# and printed with its ratio to the floor measured in the same run. Then idle dispatch, p50 of
# IDLE_N: from just before the submitting command starts (so the CLI's own start-up counts) to the
# job's first instruction, on an idle scheduler. The job is `date +%s.%N`: it prints the time it
# runs at, read from its output once it ended. (A file's mtime would not do: the kernel stamps
# files from a clock that moves once a tick, 4 ms here, and tsp's dispatch read as -2.6 ms.)
#
# Everything lives in a temporary directory, removed at the end; the daemon and the tsp server
# are started here and stopped by PID; nothing binds but their unix sockets.
#
# Run: bench/race.sh [--dir DIR | --ext4-loop]   (N=1000 jobs, IDLE_N=20, DRAINS="loop array file":
#        eventsched's drains to run, RUNS=1: rounds of every drain, alternating, each row then the
#        median of its rounds; all can be set in the environment; IDLE_N=0: no dispatch probe)
# --dir DIR: that temporary directory is made in DIR, so every contestant (xargs runs there too,
# tsp keeps its output files there, eventsched its state) works on DIR's file system, whose type
# and journal mode are printed first. Without it: under /tmp.
# --ext4-loop: on a journaled ext4 (mkfs.ext4's defaults: data=ordered) made for the run on a loop
# device, as the servers our users run have; needs root; unmounted and deleted at the end.
set -euo pipefail
DIR=/tmp
LOOP_IMG="" LOOP_MNT=""
unmount_loop() {
  [ -z "$LOOP_MNT" ] && return
  umount "$LOOP_MNT" 2>/dev/null || true
  rmdir "$LOOP_MNT" 2>/dev/null || true
  rm -f "$LOOP_IMG"
}
trap unmount_loop EXIT
case ${1:-} in
  --dir) DIR=${2:?race: --dir needs a folder}; [ -d "$DIR" ] || { echo "race: no folder $DIR" >&2; exit 2; } ;;
  --ext4-loop)
    [ "$(id -u)" = 0 ] || { echo "race: --ext4-loop needs root (mount)" >&2; exit 2; }
    LOOP_IMG=$(mktemp /var/tmp/eventsched-race-ext4.XXXXXX) LOOP_MNT=$(mktemp -d /mnt/eventsched-race.XXXXXX)
    truncate -s 2G "$LOOP_IMG"
    mkfs.ext4 -q -F "$LOOP_IMG"
    mount -o loop "$LOOP_IMG" "$LOOP_MNT"
    DIR=$LOOP_MNT ;;
  "") ;;
  *) echo "race: usage: bench/race.sh [--dir DIR | --ext4-loop]" >&2; exit 2 ;;
esac
DIR=$(cd "$DIR" && pwd)
cd "$(dirname "$0")/.."
ROOT=$PWD
N=${N:-1000}
IDLE_N=${IDLE_N:-20}
RUNS=${RUNS:-1}
DRAINS=" ${DRAINS:-loop array file} "
ES=${EVENTSCHED:-$ROOT/.venv/bin/eventsched}
PY=$(dirname "$ES")/python  # the one beside it: its tree's Client
# a user's shell does not set it; with it, each CLI call would compile its modules again
unset PYTHONDONTWRITEBYTECODE
[ -x "$ES" ] || { echo "race: no $ES; run scripts/setup.sh first" >&2; exit 1; }

# "FSTYPE on SOURCE, journal: MODE" of the file system holding $1
fs_line() {
  local src fstype opts journal dev
  read -r src fstype opts < <(findmnt -n -o SOURCE,FSTYPE,OPTIONS --target "$1")
  case $fstype in
    ext3|ext4)
      dev=$(basename "$(readlink -f "$src")")
      if features=$(dumpe2fs -h "$src" 2>/dev/null | grep '^Filesystem features:'); then
        [[ $features == *has_journal* ]] && journal=yes || journal=no
      elif [ -d "/proc/fs/jbd2/$dev-8" ]; then journal=yes  # dumpe2fs needs read access to the device
      else journal=unknown; fi
      case $journal in
        yes) journal="journaled, $(grep -o 'data=[a-z]*' <<<"$opts" || echo data=ordered)" ;;
        no) journal="no journal" ;;
        *) journal="unknown (dumpe2fs -h $src needs read access)" ;;
      esac ;;
    tmpfs|ramfs) journal="none (memory)" ;;
    xfs|btrfs|zfs|f2fs) journal="its own log" ;;
    *) journal="unknown" ;;
  esac
  echo "$fstype on $src, journal: $journal ($opts)"
}
FS=$(fs_line "$DIR")
echo "race: in $DIR: $FS"
command -v tsp >/dev/null ||
  echo "race: task-spooler is not installed (no tsp; Debian package task-spooler, scripts/install-bench-tools.sh): its row is skipped" >&2

WORK=$(mktemp -d "$DIR/eventsched-race.XXXXXX")
DAEMON_PID=""
cleanup() {
  if [ -n "$DAEMON_PID" ]; then
    kill "$DAEMON_PID" 2>/dev/null || true
    for _ in $(seq 100); do kill -0 "$DAEMON_PID" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$DAEMON_PID" 2>/dev/null || true
  fi
  if [ -S "$WORK/tsp.socket" ]; then
    TS_SOCKET=$WORK/tsp.socket tsp -K >/dev/null 2>&1 || true  # stops our tsp server (that socket's alone)
  fi
  rm -rf "$WORK"
  unmount_loop
}
trap cleanup EXIT

now() { echo "$EPOCHREALTIME"; }
sub() { "$PY" -c 'import sys; print(f"{float(sys.argv[1]) - float(sys.argv[2]):.6f}")' "$1" "$2"; }
ratio() { "$PY" -c 'import sys; print(f"{float(sys.argv[1]) / float(sys.argv[2]):.2f}x")' "$1" "$2"; }
median() { sort -g | awk '{a[NR]=$1} END {print (NR % 2) ? a[(NR+1)/2] : (a[NR/2] + a[NR/2+1]) / 2}'; }
# the job that reports when it ran: GNU date's nanoseconds
STAMP=(date +%s.%N)

declare -A DRAIN  # contestant -> its drains, one line per round
report() { printf '%-44s %8.3f s   %s\n' "$1" "$2" "$3"; }
# the median of a contestant's rounds, and what each took if there were several
drain_of() { grep . <<<"${DRAIN[$1]}" | median; }
rounds_of() { [ "$RUNS" -gt 1 ] && echo "   (rounds: $(grep . <<<"${DRAIN[$1]}" | paste -sd " "))"; true; }
record() { DRAIN[$1]+="$2"$'\n'; }

floor_round() {
  local t0
  t0=$(now)
  (cd "$WORK" && seq "$N" | xargs -P 4 -n 1 true)
  record floor "$(sub "$(now)" "$t0")"
}

# --- task-spooler --------------------------------------------------------------------------------
TSP_DISPATCH=""
if command -v tsp >/dev/null; then
  # our own server: its socket and its output files in $WORK, 4 slots
  mkdir -p "$WORK/tsp"
  ts() { TMPDIR=$WORK/tsp TS_SOCKET=$WORK/tsp.socket TS_SLOTS=4 TS_MAXFINISHED=$((N + IDLE_N + 10)) tsp "$@"; }
  ts -S 4  # starts the server
  tsp_round() {
    local t0 left
    t0=$(now)
    for _ in $(seq "$N"); do ts true >/dev/null; done
    ts -w >/dev/null 2>&1 || true  # waits for the last job added
    record tsp "$(sub "$(now)" "$t0")"
    left=$(ts -l | awk 'NR > 1 && ($2 == "running" || $2 == "queued")' | wc -l)
    [ "$left" = 0 ] || echo "race: tsp still has $left jobs after its last one ended" >&2
    ts -C  # forgets the finished jobs (their output files stay until the end)
  }
  tsp_dispatch() {
    local t0 id
    for _ in $(seq "$IDLE_N"); do
      t0=$(now)
      id=$(ts "${STAMP[@]}")
      ts -w "$id" >/dev/null 2>&1 || true
      sub "$(head -n 1 "$(ts -o "$id")")" "$t0" >>"$WORK/tsp-dispatch"
      sleep 0.05
    done
    [ "$IDLE_N" -gt 0 ] && TSP_DISPATCH=$(median <"$WORK/tsp-dispatch")
    ts -K >/dev/null 2>&1 || true
  }
fi

# --- eventsched ----------------------------------------------------------------------------------
export EVENTSCHED_STATE_DIR=$WORK/es
unset EVENTSCHED_SOCKET
mkdir -p "$EVENTSCHED_STATE_DIR"
"$ES" serve --gpus fake:4 >"$WORK/daemon.log" 2>&1 &
DAEMON_PID=$!
for _ in $(seq 300); do "$ES" health >/dev/null 2>&1 && break; sleep 0.1; done
"$ES" health >/dev/null || { cat "$WORK/daemon.log" >&2; exit 1; }

# the last job's end among the $2 jobs with ids > $1, once each has ended: told by the daemon's
# event stream from seq $3 on (a listing polled meanwhile would cost the daemon a forecast of the
# queue each time)
drained_at() {
  "$PY" - "$1" "$2" "$3" <<'PY'
import sys
from eventsched import Client
after, n, since = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
ended: set[int] = set()
with Client() as c:
    for batch in c.subscribe(from_seq=since):
        ended.update(e.job for e in batch if type(e).__name__ in ("JobExited", "JobCancelled", "JobLost") and e.job > after)
        if len(ended) >= n:
            break
    jobs = [j for j in c.jobs(all=True) if j["id"] > after]
bad = [j for j in jobs if j["state"] != "succeeded"]
if bad:
    sys.exit(f"race: {len(bad)} jobs did not succeed, e.g. {bad[0]}")
print(max(j["ended_at"] for j in jobs))
PY
}
# "LAST_JOB_ID NEXT_SEQ": where a round's jobs and events begin
mark() {
  "$PY" -c 'from eventsched import Client
with Client() as c: print(max([j["id"] for j in c.jobs(all=True)], default=0), c.ping()["seq"] + 1)'
}

if [[ $DRAINS == *" file "* ]]; then
  mkdir -p "$WORK/jobs" "$WORK/shadow"
  ln -s "$(type -P true)" "$WORK/shadow/python"
  : >"$WORK/jobs/noop.py"
  # one file a round: submit-file skips the lines of a file it has submitted before
  for round in $(seq "$RUNS"); do
    { echo "# priority,script_path,conda_env,arguments,allowed_gpus"
      for i in $(seq "$N"); do echo "0,$WORK/jobs/noop.py,,--seed $i,"; done; } >"$WORK/jobs/jobs-$round.txt"
  done
fi

# round $2 of eventsched's drain $1 (loop, array or file)
es_round() {
  local before since t0
  read -r before since < <(mark)
  t0=$(now)
  case $1 in
    loop) for _ in $(seq "$N"); do "$ES" submit --gpus 1 -- true >/dev/null; done ;;
    array) "$ES" submit --gpus 1 --array "0-$((N - 1))" -- true >/dev/null ;;
    file) PATH=$WORK/shadow:$PATH "$ES" submit-file "$WORK/jobs/jobs-$2.txt" >/dev/null ;;
  esac
  record "$1" "$(sub "$(drained_at "$before" "$N" "$since")" "$t0")"
}

# --- the rounds: each contestant once per round, in the same order ---------------------------------
for round in $(seq "$RUNS"); do
  floor_round
  if command -v tsp >/dev/null; then tsp_round; fi
  for drain in loop array file; do
    if [[ $DRAINS == *" $drain "* ]]; then es_round "$drain" "$round"; fi
  done
done
if command -v tsp >/dev/null; then tsp_dispatch; fi

for _ in $(seq "$IDLE_N"); do
  t0=$(now)
  id=$("$ES" submit --gpus 1 -- "${STAMP[@]}")
  stamp=""
  for _ in $(seq 400); do  # its output, once the job ran (polled after the fact: no load meanwhile)
    sleep 0.05
    stamp=$("$ES" logs "$id" 2>/dev/null | head -n 1)
    [ -n "$stamp" ] && break
  done
  [ -n "$stamp" ] || { echo "race: job $id printed no time" >&2; exit 1; }
  sub "$stamp" "$t0" >>"$WORK/es-dispatch"
done
[ "$IDLE_N" -gt 0 ] && ES_DISPATCH=$(median <"$WORK/es-dispatch")

# --- the table -----------------------------------------------------------------------------------
echo "race: $N jobs of true, at most 4 at a time ($(nproc) CPUs); drain from the first submission to the last job's end"
echo "race: file system: $FS"
[ "$RUNS" -gt 1 ] && echo "race: each row the median of $RUNS rounds, each ratio to the floor's median"
FLOOR=$(drain_of floor)
report "xargs -P 4 -n 1 true (the floor)" "$FLOOR" "1.0x$(rounds_of floor)"
if [ -n "${DRAIN[tsp]:-}" ]; then
  report "task-spooler: bash loop of tsp true" "$(drain_of tsp)" "$(ratio "$(drain_of tsp)" "$FLOOR")$(rounds_of tsp)"
else
  echo "task-spooler: NOT RUN: tsp is not installed (Debian package task-spooler; scripts/install-bench-tools.sh)"
fi
row() {
  [ -z "${DRAIN[$1]:-}" ] && return
  local vs_tsp=""
  [ -n "${DRAIN[tsp]:-}" ] && vs_tsp=", $(ratio "$(drain_of "$1")" "$(drain_of tsp)") task-spooler's"
  report "$2" "$(drain_of "$1")" "$(ratio "$(drain_of "$1")" "$FLOOR")$vs_tsp$(rounds_of "$1")"
}
row loop "eventsched: bash loop of eventsched submit"
row array "eventsched: submit --array 0-$((N - 1))"
row file "eventsched: submit-file ($N lines)"
[ "$IDLE_N" -gt 0 ] || exit 0
echo "idle dispatch p50 of $IDLE_N, the submitting command's start to the job's first instruction:"
[ -n "$TSP_DISPATCH" ] && printf '  %-42s %6.1f ms\n' "tsp date +%s.%N" "$("$PY" -c "print($TSP_DISPATCH * 1e3)")"
printf '  %-42s %6.1f ms\n' "eventsched submit --gpus 1 -- date +%s.%N" "$("$PY" -c "print($ES_DISPATCH * 1e3)")"
