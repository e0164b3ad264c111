#!/bin/sh
# The Alibaba openb pods as a dynamic workload (synthetic schedule, see README.md),
# under every policy; writes comparison.txt and comparison.json.
set -e
here=$(cd "$(dirname "$0")" && pwd)
traces="$here/../../../shared/traces"
out=$(mktemp -d)
policies="--policy fifo --policy priority --policy best-fit --policy sjf-backfill --policy fgd"
eventsched replay "$traces/openb_pod_list_default.csv" $policies --out "$out/t" --json \
    | sed "s|$out/t|<out>|g; s|$traces/||g" > "$here/comparison.json"
python3 - "$here/comparison.json" > "$here/comparison.txt" <<'PY'
import json, sys
from eventsched.whatif import format_comparison
print(format_comparison(json.load(open(sys.argv[1]))))
PY
cat "$here/comparison.txt"
rm -rf "$out"
