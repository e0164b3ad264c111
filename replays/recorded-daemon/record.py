"""Record a real daemon run to replay: `python replays/recorded-daemon/record.py`.

Starts `eventsched serve --gpus fake:4:16384 --policy fifo` in a temporary
state dir, submits 40 short jobs (sleeps of 0.2-2.5 s; shares, whole GPUs and
gangs; a few failing with one retry, a few over a time limit, one cancelled,
GPU 2 paused for a while), waits for them all, stops the daemon and copies
its event log to ./log (then run ./run.sh).
"""

from __future__ import annotations

import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

here = Path(__file__).resolve().parent
repo = here.parent.parent
sys.path.insert(0, str(repo / "tests"))
from daemon_harness import Daemon  # noqa: E402


def main() -> int:
    rng = random.Random(5)
    state = Path(tempfile.mkdtemp(prefix="eventsched-record-")) / "state"
    d = Daemon(state, gpus="fake:4:16384", extra=["--policy", "fifo"]).start()
    ids = []
    try:
        for i in range(40):
            gpus = rng.choice(["0.25", "0.5", "0.5", "1", "1", "2", "4"])
            secs = f"{rng.uniform(0.2, 2.5):.2f}"
            extra = ["--priority", str(rng.choice([0, 0, 0, 1]))]
            if i % 11 == 5:
                extra += ["--retries", "1"]
                cmd = ["sh", "-c", f"sleep {secs}; exit 3"]
            elif i % 13 == 7:
                extra += ["--time-limit", "1"]
                cmd = ["sleep", "5"]
            else:
                cmd = ["sleep", secs]
            ids.append(d.submit("--gpus", gpus, *extra, "--", *cmd))
            if i == 10:
                d.cli("pause-gpu", "2")
            if i == 25:
                d.cli("resume-gpu", "2")
                d.cli("cancel", str(ids[-3]))
            time.sleep(rng.uniform(0.0, 0.4))
        d.wait_states(ids, {"succeeded", "failed", "cancelled"}, timeout=300)
    finally:
        d.stop()
    shutil.rmtree(here / "log", ignore_errors=True)
    shutil.copytree(state / "log", here / "log", ignore=shutil.ignore_patterns("LOCK"))
    print(f"recorded {len(ids)} jobs; log copied to {here / 'log'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
