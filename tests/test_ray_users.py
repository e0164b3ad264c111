"""Several users on several machines: a job on a remote node runs as its submitter.

A root daemon (``serve --ray``) on a Ray cluster of its own (a head without
GPUs and one node, ``gpu-a``, declaring two fake GPUs, all bound to
127.0.0.1, all run as root), and real users (``users_harness``) who submit
through the daemon's socket as themselves. The node looks each user up by
name in its own passwd and group. The tests at the top drive a ``NodeAgent``
without Ray.
"""

from __future__ import annotations

import asyncio
import grp
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
from processes import alive
from ray_harness import local_cluster
from users_harness import User, as_user, needs_root, public_dir, root_daemon, third_user, users  # noqa: F401

from eventsched.domain.events import JobSpec
from eventsched.domain.messages import ProcessExited
from eventsched.runtime.cluster.ray_node_actor import NodeAgent

pytestmark = [pytest.mark.slow, needs_root]

NODE = "gpu-a"
ID = ["sh", "-c", 'id -u; id -g; id -G; echo "$HOME"; umask']


def _identity(output: str) -> tuple[int, int, set[int], str, int]:
    """(uid, gid, groups, home, umask) from what ``ID`` printed."""
    uid, gid, groups, home, umask = output.splitlines()[:5]
    return int(uid), int(gid), set(map(int, groups.split())), home, int(umask, 8)


def _expected(user: User, umask: int) -> tuple[int, int, set[int], str, int]:
    """``_identity`` of ``user`` as this machine knows them."""
    return user.uid, user.gid, set(os.getgrouplist(user.name, user.gid)), user.home, umask


@pytest.fixture(scope="module")
def extra_group(users: tuple[User, User]) -> Iterator[str]:  # noqa: F811
    """A supplementary group of alice's, so that her groups are more than her own."""
    name = f"esg{str(os.getpid())[-5:]}"
    subprocess.run(["groupdel", name], capture_output=True)
    subprocess.run(["groupadd", name], check=True, capture_output=True)
    subprocess.run(["usermod", "-aG", name, users[0].name], check=True, capture_output=True)
    try:
        yield name
    finally:
        subprocess.run(["groupdel", name], capture_output=True)


# --- a node agent, without Ray ----------------------------------------------------------


def test_a_node_without_the_user_refuses_the_launch_in_one_line(tmp_path: Path) -> None:
    agent = NodeAgent("gpu-x", str(tmp_path), "fake:1")
    spec = JobSpec(command=["true"], user="no-such-user-es", uid=4242, gid=4242, groups=[4242], home="/")
    kind, reason = asyncio.run(agent.launch(1, spec, [0], 1))
    assert (kind, reason) == ("failed", "node gpu-x has no user no-such-user-es")
    assert not (tmp_path / "nodes" / "gpu-x" / "jobs" / "1.1").exists()  # nothing was launched


def _run_on_agent(state_dir: Path, spec: JobSpec) -> str:
    """Run one job through a node agent, as the daemon would through Ray; its output."""
    async def run() -> list[Any]:
        agent = NodeAgent("gpu-x", str(state_dir), "fake:1")
        await agent.hello()
        kind, started = await agent.launch(1, spec, [0], 1)
        assert kind == "started", started
        return (await agent.poll(30.0))[1]

    out = asyncio.run(run())
    assert [type(m) for _, m in out] == [ProcessExited] and out[0][1].exit_code == 0, out
    return (state_dir / "nodes" / "gpu-x" / "jobs" / "1.log").read_text()


def test_the_node_takes_the_users_identity_from_its_own_passwd_by_name(
    tmp_path: Path, users: tuple[User, User], extra_group: str  # noqa: F811
) -> None:
    alice = users[0]
    # what the head saw (its own uids, groups, home) is not what this node has
    spec = JobSpec(command=ID, user=alice.name, uid=54321, gid=54321, groups=[54321], home="/head/home", umask=0o077)
    output = _run_on_agent(tmp_path, spec)
    assert _identity(output) == _expected(alice, 0o077)
    assert grp.getgrnam(extra_group).gr_gid in _identity(output)[2]
    log = tmp_path / "nodes" / "gpu-x" / "jobs" / "1.log"
    assert (log.stat().st_uid, log.stat().st_mode & 0o777) == (alice.uid, 0o600)


@pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux")
def test_a_session_job_on_a_node_writes_its_own_output(
    public_dir: Path, users: tuple[User, User]  # noqa: F811
) -> None:
    spec = JobSpec(command=["sh", "-c", "echo in the session; id -u"], user=users[1].name, uid=1, session="tmux")
    # the session writes the output by path, as its user: the node's state dir lets it through
    assert _run_on_agent(public_dir / "session", spec).split() == ["in", "the", "session", str(users[1].uid)]


# --- a real Ray cluster, a root daemon, real users ---------------------------------------


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[Any]:
    with local_cluster((NODE,)) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def ray_daemon(ray_cluster: Any, public_dir: Path) -> Iterator[Any]:  # noqa: F811
    config = public_dir / "ray.toml"
    config.write_text("[scheduler]\nkill_grace_s = 2\nmax_host_mem_mib = 200\n")
    d = root_daemon(public_dir, "--ray", ray_cluster.address, "--config", str(config), gpus="fake:2:16384")
    d.start(timeout=90)
    try:
        deadline = time.monotonic() + 90
        while not any(n["name"] == NODE and n["state"] == "up" for n in json.loads(d.cli("nodes", "--json").stdout)):
            assert time.monotonic() < deadline, f"{NODE} never joined: {d.stderr()}"
            time.sleep(0.3)
        yield d
    finally:
        d.stop()


def _submit(user: User, d: Any, *command: str) -> int:
    r = as_user(user, d.state_dir, "submit", "--node", NODE, "--gpus", "1", "--", *command)
    assert r.returncode == 0, r.stderr
    return int(r.stdout)


def _marked(marker: str) -> list[int]:
    """Pids of the live processes with ``marker`` in their argv."""
    out = []
    for name in os.listdir("/proc"):
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                argv = f.read()
        except OSError:
            continue
        if name.isdigit() and marker.encode() in argv and alive(int(name)):
            out.append(int(name))
    return out


def test_each_users_job_on_a_remote_node_runs_as_them_and_cannot_read_the_other(
    ray_daemon: Any, users: tuple[User, User], public_dir: Path, extra_group: str  # noqa: F811
) -> None:
    alice, bob = users
    umask = os.umask(0o022)
    os.umask(umask)
    secret = {}
    for user in users:  # each user's private file, in a folder both may traverse
        secret[user.name] = public_dir / f"{user.name}.secret"
        secret[user.name].write_text(f"{user.name}'s secret\n")
        os.chown(secret[user.name], user.uid, user.gid)
        secret[user.name].chmod(0o600)
    jobs = {user.name: _submit(user, ray_daemon, *ID[:2], f"{ID[2]}; cat {secret[other.name]}")
            for user, other in ((alice, bob), (bob, alice))}
    done = ray_daemon.wait_states(list(jobs.values()), {"succeeded", "failed"}, timeout=90)
    for user in users:
        job = jobs[user.name]
        assert done[job]["node"] == NODE and done[job]["user"] == user.name
        assert (done[job]["state"], done[job]["exit_code"]) == ("failed", 1)  # cat was refused
        out = as_user(user, ray_daemon.state_dir, "logs", str(job))  # the mirrored output, read as its owner
        assert out.returncode == 0, out.stderr
        assert _identity(out.stdout) == _expected(user, umask)  # the submitter's umask, sent by the CLI
        assert "Permission denied" in out.stdout.splitlines()[-1] and "secret\n" not in out.stdout
        if user is alice:
            assert grp.getgrnam(extra_group).gr_gid in _identity(out.stdout)[2]
    # each one's output is theirs alone
    assert as_user(bob, ray_daemon.state_dir, "logs", str(jobs[alice.name])).returncode != 0


def test_cancel_stops_the_whole_process_tree_on_the_node(
    ray_daemon: Any, users: tuple[User, User]  # noqa: F811
) -> None:
    alice = users[0]
    marker = f"4242.{os.getpid()}"
    job = _submit(alice, ray_daemon, "sh", "-c", f"sleep {marker} & sleep {marker} & wait", marker)
    deadline = time.monotonic() + 60
    while len(_marked(marker)) < 3:  # the shell and its two children
        assert time.monotonic() < deadline, ray_daemon.jobs()[job]
        time.sleep(0.2)
    assert {os.stat(f"/proc/{p}").st_uid for p in _marked(marker)} == {alice.uid}
    r = as_user(alice, ray_daemon.state_dir, "cancel", str(job))
    assert r.returncode == 0, r.stderr
    ray_daemon.wait_states([job], {"cancelled"}, timeout=30)
    deadline = time.monotonic() + 2 + 5  # the grace, and a little
    while _marked(marker):
        assert time.monotonic() < deadline, f"left running: {_marked(marker)}"
        time.sleep(0.2)


def test_the_daemons_host_memory_ceiling_holds_on_the_node(
    ray_daemon: Any, users: tuple[User, User]  # noqa: F811
) -> None:
    hog = _submit(users[1], ray_daemon, sys.executable, "-c", "b = bytearray(400 << 20); print('survived')")
    job = ray_daemon.wait_states([hog], {"succeeded", "failed"}, timeout=60)[hog]
    assert (job["state"], job["exit_reason"]) == ("failed", "host memory limit"), job
    assert "survived" not in as_user(users[1], ray_daemon.state_dir, "logs", str(hog)).stdout


def test_a_user_the_node_does_not_know_fails_with_the_reason(
    ray_daemon: Any, third_user: User  # noqa: F811
) -> None:
    d = ray_daemon
    for gpu in (f"{NODE}:0", f"{NODE}:1"):  # the job waits while carol leaves the node
        assert d.cli("pause-gpu", gpu).returncode == 0
    try:
        job = _submit(third_user, d, "true")
        subprocess.run(["userdel", "-r", "-f", third_user.name], check=True, capture_output=True)
    finally:
        for gpu in (f"{NODE}:0", f"{NODE}:1"):
            assert d.cli("resume-gpu", gpu).returncode == 0
    assert d.wait_states([job], {"failed"}, timeout=60)[job]["exit_code"] is None
    reason = f"node {NODE} has no user {third_user.name}"
    explain = d.cli("explain", str(job))
    assert explain.returncode == 0 and reason in explain.stdout, explain.stdout
    assert reason in d.cli("queue", "--all", "--json").stdout
