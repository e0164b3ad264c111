#!/bin/sh
# Replay workload.csv on 8 fake GPUs under every policy; writes comparison.txt / .json.
# Run from anywhere: sh replays/synthetic/run.sh
set -e
here=$(cd "$(dirname "$0")" && pwd)
out=$(mktemp -d)
policies="--policy fifo --policy priority --policy best-fit --policy sjf-backfill --policy fgd"
eventsched replay "$here/workload.csv" --gpus fake:8:81920 $policies --out "$out/txt" \
    | sed "s|$out/txt|<out>|g; s|$here/||g" > "$here/comparison.txt"
eventsched replay "$here/workload.csv" --gpus fake:8:81920 $policies --out "$out/json" --json \
    | sed "s|$out/json|<out>|g; s|$here/||g" > "$here/comparison.json"
cat "$here/comparison.txt"
rm -rf "$out"
