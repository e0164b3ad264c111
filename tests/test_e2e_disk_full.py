"""Disk full: submissions are refused with a clear error, nothing written
before is damaged, and the daemon works again once space returns."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from daemon_harness import Daemon

from eventsched.domain.events import JobSpec
from eventsched.wire.client import Client, ClientError

pytestmark = [pytest.mark.slow, pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs needs root")]


@pytest.fixture
def small_disk(tmp_path: Path):
    mount = tmp_path / "disk"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=32m", "tmpfs", str(mount)]).returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)])


def fill(path: Path) -> None:
    """Write until the filesystem is full."""
    with open(path, "wb", buffering=0) as f:
        size = 1 << 16
        while size:  # then smaller and smaller writes: not even a small log frame may fit
            try:
                f.write(b"\0" * size)
            except OSError:
                size //= 2


def test_disk_full_refuses_submissions_and_recovers(small_disk: Path) -> None:
    with Daemon(small_disk / "state", gpus="fake:2") as d:
        before = [d.submit("--gpus", "0.5", "--", "/bin/true") for _ in range(3)]
        d.wait_states(before, {"succeeded"})
        filler = small_disk / "filler"
        fill(filler)
        # The log's segment has space written ahead (zeros, storage/log.py
        # PREALLOCATE): it goes on accepting, durably, until that is used.
        # Big submissions use it up, then smaller ones what they leave.
        reserved: list[int] = []
        with Client(d.socket) as c:
            for pad in (60_000, 8_000, 1_000, 0):
                for _ in range(200):
                    spec = JobSpec(command=["/bin/true"], gpus=0.5, cwd="/tmp", env={"PAD": "x" * pad} if pad else {})
                    try:
                        reserved.append(c.submit(spec))
                    except ClientError as exc:
                        assert "space" in str(exc).lower(), exc
                        break
                else:
                    pytest.fail(f"submissions of {pad} bytes were never refused on a full disk")
        assert 10 <= len(reserved) <= 400, f"{len(reserved)} accepted into 1 MiB written ahead"
        # a small frame may still fit in what is left: that one is accepted, durably; then refusals
        accepted, refused = [], []
        for _ in range(10):
            r = d.cli("submit", "--gpus", "0.5", "--", "/bin/true")
            (accepted if r.returncode == 0 else refused).append(r)
            if len(refused) == 3:
                break
        assert len(refused) == 3 and len(accepted) <= 2, [(r.returncode, r.stderr) for r in accepted + refused]
        for r in refused:
            assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
            assert "space" in r.stderr.lower() or "full" in r.stderr.lower(), r.stderr
        squeezed = reserved + [int(r.stdout) for r in accepted]
        assert d.cli("health").returncode == 0, "the daemon stays up"
        filler.unlink()
        after = d.submit("--gpus", "0.5", "--", "/bin/true")
        jobs = d.wait_states(before + [after], {"succeeded"})
        # one accepted on the full disk may fail to launch, saying why
        jobs = d.wait_states(squeezed, {"succeeded", "failed"})
        for j in squeezed:
            assert jobs[j]["state"] == "succeeded" or "No space left" in jobs[j]["exit_reason"], jobs[j]
        assert len(jobs) == len(before) + len(squeezed) + 1, "refused submissions left nothing behind"
        assert d.cli("log", "verify", str(d.state_dir / "log")).returncode == 0

