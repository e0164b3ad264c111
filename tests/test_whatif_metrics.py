"""Same schedule, same figures: the what-if metrics read the schedule alone.

A daemon logs samples, timer facts and its own starts at other times than a
simulator does; no metric may move with them (docs/whatif-metrics.md).
"""

from __future__ import annotations

import functools
import sys
import tempfile
from pathlib import Path

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from eventsched.domain import events as ev
from eventsched.sim.compare import compare_placements
from eventsched.sim.simulator import RECORDED, simulate
from eventsched.sim.sources import load_source
from eventsched.sim.whatif import metrics_from_events, metrics_from_log
from eventsched.storage import log as eventlog

sys.path.insert(0, str(Path(__file__).parent))
from test_replay import record

BENCH = Path(__file__).resolve().parents[1] / "bench"


@functools.cache
def _recorded(policy: str, seed: int) -> tuple[ev.Event, ...]:
    """A recorded log with samples, timers, operators and a restart."""
    with tempfile.TemporaryDirectory() as tmp:
        return tuple(eventlog.read(record(Path(tmp), policy, seed)))


def _noise(events: tuple[ev.Event, ...], times: list[float], drop: set[int]) -> list[ev.Event]:
    """The same schedule logged differently: samples dropped, others added at
    ``times`` (offsets from the first event, before the first submission and
    after the last job event too), out of time order as a sampler thread may be."""
    sample = next(e for e in events if type(e) is ev.GpuSampled)
    t0 = events[0].ts
    out = [e for i, e in enumerate(events) if not (i in drop and type(e) in (ev.GpuSampled, ev.TimerFired))]
    for k, dt in enumerate(times):
        pos = (k * 7919) % (len(out) + 1)
        out.insert(pos, msgspec.structs.replace(sample, ts=t0 + dt))
    return out


@settings(max_examples=40, deadline=None)
@given(
    policy=st.sampled_from(["fifo", "best-fit", "sjf-backfill"]),
    times=st.lists(st.floats(min_value=-50.0, max_value=500.0, allow_nan=False), max_size=30),
    drop=st.sets(st.integers(min_value=0, max_value=3000), max_size=300),
)
def test_metrics_do_not_move_with_samples_or_timers(policy: str, times: list[float], drop: set[int]) -> None:
    events = _recorded(policy, 3)
    assert metrics_from_events(_noise(events, times, drop)) == metrics_from_events(events)


def test_idle_time_before_the_first_submission_and_after_the_last_exit_is_not_counted() -> None:
    events = _recorded("best-fit", 4)
    m = metrics_from_events(events)
    assert 0 < m.fragmentation < 1
    sample = next(e for e in events if type(e) is ev.GpuSampled)
    # a daemon started a minute early and stopped a minute late: the same schedule
    early = msgspec.structs.replace(events[0], ts=events[0].ts - 60) if type(events[0]) is ev.DaemonStarted else None
    padded = ([early] if early else []) + list(events) + [msgspec.structs.replace(sample, ts=events[-1].ts + 60)]
    assert metrics_from_events(padded) == m


# --- on real daemons ------------------------------------------------------------------------------


def _bench() -> object:
    sys.path.insert(0, str(BENCH))
    import prediction_vs_reality

    return prediction_vs_reality


@pytest.mark.slow
@pytest.mark.parametrize("policy, seed", [("best-fit", 1), ("fifo", 2)])
def test_a_daemon_log_and_its_exact_replay_give_identical_metrics(tmp_path: Path, policy: str, seed: int) -> None:
    pvr = _bench()
    work = pvr.operators(seed)  # type: ignore[attr-defined]
    state = pvr.run_live(work, policy, tmp_path / "live")  # type: ignore[attr-defined]
    simulate(load_source(state), RECORDED, tmp_path / "replay")
    assert compare_placements(state / "log", tmp_path / "replay" / "log") is None
    live, replay = metrics_from_log(state / "log"), metrics_from_log(tmp_path / "replay" / "log")
    assert live.jobs == len(work.jobs) and live.fragmentation > 0
    for key, value in msgspec.structs.asdict(live).items():
        assert getattr(replay, key) == value, key  # exactly: the same schedule, the same floats
