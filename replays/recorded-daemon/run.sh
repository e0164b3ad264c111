#!/bin/sh
# Replay the recorded daemon log under its own policy and the others; writes comparison.txt.
set -e
here=$(cd "$(dirname "$0")" && pwd)
out=$(mktemp -d)
eventsched replay "$here/log" --policy recorded --policy fifo --policy priority --policy best-fit \
    --policy sjf-backfill --policy fgd --out "$out" | sed "s|$out|<out>|g; s|$here/||g" > "$here/comparison.txt"
cat "$here/comparison.txt"
rm -rf "$out"
