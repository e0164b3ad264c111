#!/bin/sh
# FIFO vs fair share on workload.csv (three tenants, one floods), 8 fake GPUs,
# the tenants of tenants.toml; writes comparison.txt / .json.
# Run from anywhere: sh replays/multi-tenant/run.sh
set -e
here=$(cd "$(dirname "$0")" && pwd)
out=$(mktemp -d)
policies="--policy fifo --policy best-fit --policy fair-share"
eventsched replay "$here/workload.csv" --gpus fake:8:81920 --config "$here/tenants.toml" $policies --out "$out/txt" \
    | sed "s|$out/txt|<out>|g; s|$here/||g" > "$here/comparison.txt"
eventsched replay "$here/workload.csv" --gpus fake:8:81920 --config "$here/tenants.toml" $policies --out "$out/json" --json \
    | sed "s|$out/json|<out>|g; s|$here/||g" > "$here/comparison.json"
cat "$here/comparison.txt"
rm -rf "$out"
