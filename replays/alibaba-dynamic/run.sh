#!/bin/sh
# The Alibaba openb pods as a dynamic workload (synthetic schedule, see README.md),
# under every policy; writes comparison.txt and comparison.json.
set -e
here=$(cd "$(dirname "$0")" && pwd)
traces="$here/../../../shared/traces"
out=$(mktemp -d)
policies="--policy fifo --policy priority --policy best-fit --policy sjf-backfill --policy fgd --policy fair-share --policy sjf-oracle"
eventsched replay "$traces/openb_pod_list_default.csv" $policies --out "$out/txt" \
    | sed "s|$out/txt|<out>|g; s|$traces/||g" > "$here/comparison.txt"
eventsched replay "$traces/openb_pod_list_default.csv" $policies --out "$out/json" --json \
    | sed "s|$out/json|<out>|g; s|$traces/||g" > "$here/comparison.json"
cat "$here/comparison.txt"
rm -rf "$out"
