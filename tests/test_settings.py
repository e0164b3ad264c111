"""Recorded scheduler settings evolve: an old log starts today's daemon, a
newer one is refused with one clear line.

The fixture ``tests/fixtures/state_settings_v1/`` is the state directory of a
daemon from before settings were versioned: its ``DaemonStarted.config`` has no
``settings_version`` and no ``max_queued_per_user``, and other settings than
today's defaults. It is committed; regenerate it only on purpose with
``python tests/test_settings.py --write-fixture``.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
from daemon_harness import Daemon

from eventsched.domain import events as ev
from eventsched.domain.messages import SchedulerConfig
from eventsched.domain.settings import (
    SETTINGS_VERSION,
    SettingsError,
    settings_dict,
    settings_from_dict,
    upcast_v1_v2,
    upcast_v2_v3,
)
from eventsched.projections.cluster import ClusterState, apply
from eventsched.storage import log

FIXTURE = Path(__file__).parent / "fixtures" / "state_settings_v1"

# what SchedulerConfig wrote before settings were versioned, key for key
V1_CONFIG = {
    "node": "local", "policy": "fifo", "default_time_limit_s": 3600.0, "kill_grace_s": 3.0, "max_queued": 50,
    "max_running": 2, "max_gpu_memory_used_pct": 95.0, "max_gpu_utilization_pct": 100.0,
    "max_gpu_temperature_c": 85.0, "retry_backoff_s": 5.0,
}


def v1_events() -> list[ev.Event]:
    spec = ev.JobSpec(command=["/bin/true"], user="root", uid=0, gid=0, name="true", gpus=0.5)
    return [
        ev.DaemonStarted(ts=1.0, cause="daemon", node="local", pid=7, version="0.1.0", policy="fifo",
                         gpu_backend="fake:2:16384", config=V1_CONFIG),  # type: ignore[arg-type]
        *[ev.GpuDiscovered(ts=1.0, cause="daemon", node="local", gpu=i, uuid=f"FAKE-{i}", model="fake",
                           memory_total_mib=16384) for i in range(2)],
        ev.JobSubmitted(ts=2.0, cause="uid:0", job=1, spec=spec),
        ev.JobPlaced(ts=2.0, cause="policy:fifo", job=1, node="local", gpu_ids=[0], share=0.5, policy="fifo"),
        ev.JobExited(ts=3.0, cause="exit:job 1", job=1, exit_code=0),
        ev.DaemonStopped(ts=4.0, cause="daemon", node="local", reason="SIGTERM"),
    ]


def write_fixture(state: Path) -> None:
    if state.exists():
        shutil.rmtree(state)
    w = log.LogWriter.open(state / "log")
    w.append(v1_events())
    w.close()
    (state / "log" / log.LOCK_NAME).unlink()


def test_a_v1_settings_dict_is_upcast_before_it_becomes_settings() -> None:
    assert "settings_version" not in V1_CONFIG
    upcast = upcast_v1_v2(V1_CONFIG)
    assert upcast["max_queued_per_user"] == 50  # as large as its global limit: same decisions as then
    config = settings_from_dict(V1_CONFIG)
    # v2 -> v3: an old log decided by priority alone, with no aging, fair share, reservations or preemption
    old_ways = {"aging_per_hour": 0.0, "fair_share_weight": 0.0, "reserve_for_gang": False, "preemption": False}
    # v3 -> v4: an old log never looked for idle jobs; v4 -> v5: it aged continuously;
    # v5 -> v6: it placed in plain GPU order, strangers or not
    assert config == SchedulerConfig(**{**V1_CONFIG, "max_queued_per_user": 50, **old_ways,  # type: ignore[arg-type]
                                        "idle_after_s": 0.0, "aging_tiers": False, "avoid_foreign_gpus": False})
    assert upcast_v2_v3({"settings_version": 2}) == {"settings_version": 2, **old_ways}
    # today's record round-trips and carries its version
    today = settings_dict(SchedulerConfig(policy="fgd"))
    assert today["settings_version"] == SETTINGS_VERSION
    assert settings_from_dict(today) == SchedulerConfig(policy="fgd")


def test_a_newer_or_broken_settings_record_is_refused_in_one_line() -> None:
    with pytest.raises(SettingsError, match="written by a newer eventsched .*upgrade eventsched"):
        settings_from_dict({**V1_CONFIG, "settings_version": SETTINGS_VERSION + 1})
    with pytest.raises(SettingsError, match="not valid here"):
        settings_from_dict({**settings_dict(SchedulerConfig()), "kill_grace_s": "soon"})


def test_the_committed_v1_log_folds_with_its_own_settings() -> None:
    state = ClusterState()
    for event in log.read(FIXTURE / "log"):
        apply(state, event)
    assert state.policy == "fifo"
    assert state.config.max_running == 2 and state.config.max_queued_per_user == 50
    assert state.jobs[1].state == "succeeded"


@pytest.mark.slow
def test_todays_daemon_starts_on_the_v1_state_and_keeps_its_history(tmp_path: Path) -> None:
    state = tmp_path / "state"
    shutil.copytree(FIXTURE, state)
    with Daemon(state, gpus="fake:2:16384") as daemon:
        jobs = daemon.jobs()
        assert jobs[1]["state"] == "succeeded"
        job = daemon.submit("--gpus", "0.5", "--", "/bin/true")
        assert job == 2
        daemon.wait_states([job], {"succeeded"})
    recorded = [e for e in log.read(state / "log") if isinstance(e, ev.DaemonStarted)]
    assert "settings_version" not in recorded[0].config
    assert recorded[-1].config["settings_version"] == SETTINGS_VERSION


if __name__ == "__main__":
    if sys.argv[1:] == ["--write-fixture"]:
        write_fixture(FIXTURE)
        print(f"wrote {FIXTURE}")
