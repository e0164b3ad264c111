"""Run a benchmark under both builds of the hot path, alternately, in one
run: the mypyc-compiled modules and their Python sources
(``EVENTSCHED_PURE=1``, eventsched/_compiled.py). Each build runs in a
process of its own; their output is printed as it comes, under a header.

    .venv/bin/python bench/builds.py [--rounds 2] bench/bench_replay.py --skip-alibaba
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=1, help="compiled, then source, this many times")
    ap.add_argument("bench", nargs=argparse.REMAINDER, help="the benchmark script and its arguments")
    args = ap.parse_args()
    if not args.bench:
        ap.error("name a benchmark script")
    base = {k: v for k, v in os.environ.items() if k != "EVENTSCHED_PURE"}
    for r in range(args.rounds):
        for label, extra in (("compiled (mypyc)", {}), ("source (EVENTSCHED_PURE=1)", {"EVENTSCHED_PURE": "1"})):
            print(f"== round {r + 1}, {label}", flush=True)
            proc = subprocess.run([sys.executable, *args.bench], env={**base, **extra})
            if proc.returncode:
                return proc.returncode
    return 0


if __name__ == "__main__":
    sys.exit(main())
