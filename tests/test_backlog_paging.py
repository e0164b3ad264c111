"""`queue --json` is fetched a page at a time and says exactly what the
one-reply listing said: same jobs, same order, same reasons and
array counts, with and without --all, across page boundaries."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from daemon_harness import Daemon

from eventsched.domain.events import JobSpec
from eventsched.wire import protocol
from eventsched.wire.client import Client

pytestmark = pytest.mark.slow


def test_paged_listing_equals_the_whole_listing(tmp_path: Path) -> None:
    with Daemon(tmp_path / "state", gpus="fake:2:16384") as daemon, Client(daemon.socket) as c:
        hogs = c.submit_many([JobSpec(command=["sleep", "60"], cwd="/tmp", gpus=1) for _ in range(2)])
        ids = c.submit_many([JobSpec(command=["true", str(i)], cwd="/tmp", gpus=(0.5, 1.0, 2.0)[i % 3],
                                     priority=i % 3) for i in range(1_100)])
        c.submit_array(JobSpec(command=["echo", "{index}"], cwd="/tmp", gpus=1, array_cap=2), list(range(30)))
        c.cancel(ids[:40:3])  # some ended jobs among the ids, for --all and for the id walk
        for everything in (False, True):
            whole = c.jobs(all=everything, page=0)
            paged = c.jobs(all=everything, page=97)  # many pages, boundaries anywhere
            assert [j["id"] for j in paged] == [j["id"] for j in whole]
            assert paged == whole
        assert len(c.jobs(all=True, page=0)) == 2 + 1_100 + 30
        # a page: bounded, and where to go on from
        page = c.request(protocol.ListJobs(all=False, after=0, limit=10))
        assert len(page["jobs"]) == 10 and page["next"] is not None
        # the CLI prints one JSON array, as before (in its own order)
        out = daemon.cli("queue", "--json")
        assert out.returncode == 0, out.stderr
        listed = json.loads(out.stdout)
        assert isinstance(listed, list)
        assert sorted(listed, key=lambda j: j["id"]) == c.jobs(page=0)
        c.cancel(hogs)
