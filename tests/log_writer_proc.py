"""A log writer run as a separate process by the log tests.

Appends batches of deterministic events (``make_event(seq)``) and prints each
acknowledged last sequence number on its own line, flushed, *after* ``append``
returned: a number on stdout is a promise that the event is durable.

    python tests/log_writer_proc.py DIR [--count N] [--segment-bytes B]
        [--max-batch K] [--seed S] [--crash-at STAGE] [--delay S]
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import sys
import time

from eventsched.domain import events as ev
from eventsched.storage.log import LogWriter


def make_event(seq: int) -> ev.Event:
    """The event stored at ``seq`` in the test logs: content checkable from seq alone."""
    if seq % 3 == 0:
        spec = ev.JobSpec(command=["python", "train.py", f"--run={seq}"], user="alice", gpus=0.5, priority=seq % 7)
        return ev.JobSubmitted(seq=seq, ts=1_700_000_000.0 + seq, cause="uid:1000", job=seq, spec=spec)
    return ev.GpuSampled(
        seq=seq,
        ts=1_700_000_000.0 + seq,
        cause="nvml",
        node="local",
        gpu=seq % 4,
        utilization=float(seq % 101),
        memory_used_mib=seq,
        memory_total_mib=81920,
        temperature_c=40.0 + seq % 30,
        power_w=250.5,
    )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("directory")
    p.add_argument("--count", type=int, default=0, help="stop after this many events (0: forever)")
    p.add_argument("--segment-bytes", type=int, default=64 << 20)
    p.add_argument("--max-batch", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--crash-at", default="", help="SIGKILL self at this rotation stage")
    p.add_argument("--delay", type=float, default=0.0, help="sleep between appends")
    a = p.parse_args()
    rng = random.Random(a.seed)
    w = LogWriter.open(a.directory, segment_bytes=a.segment_bytes)
    if a.crash_at:
        w._fault = lambda stage: os.kill(os.getpid(), signal.SIGKILL) if stage == a.crash_at else None
    print(f"open {w.next_seq}", flush=True)
    written = 0
    while not a.count or written < a.count:
        k = rng.randint(1, a.max_batch)
        if a.count:
            k = min(k, a.count - written)
        first = w.next_seq
        last = w.append([make_event(s) for s in range(first, first + k)])
        written += k
        sys.stdout.write(f"{last}\n")
        sys.stdout.flush()
        if a.delay:
            time.sleep(a.delay)
    w.close()
    print("done", flush=True)


if __name__ == "__main__":
    main()
