"""The wall clock jumping during a run, and a daemon paused like a suspended machine.

The daemon's time is a ``SteadyClock``: the wall clock read at start-up, moved
on by the monotonic clock, so time limits, aging and GPU-use accounting follow
elapsed time, and the times in the log never go backwards. The slow tests run a
real daemon under libfaketime (``apt-get install faketime``), whose wall clock
the test steps forward a day or back an hour in the middle of a run
(``FAKETIME_DONT_FAKE_MONOTONIC=1``: as with a real step, the monotonic clock
goes on), and one that is stopped with SIGSTOP for seconds and continued.
"""

from __future__ import annotations

import itertools
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from eventsched.domain import events as ev
from eventsched.runtime.ports import SteadyClock
from eventsched.storage import log as eventlog

LIBFAKETIME = next(
    (p for p in ("/usr/lib/x86_64-linux-gnu/faketime/libfaketimeMT.so.1",
                 "/usr/lib/aarch64-linux-gnu/faketime/libfaketimeMT.so.1",
                 "/usr/lib/faketime/libfaketimeMT.so.1") if os.path.exists(p)),
    None,
)
needs_faketime = pytest.mark.skipif(LIBFAKETIME is None, reason="libfaketime is not installed (apt-get install faketime)")


# --- the clock itself -------------------------------------------------------------


class Clocks:
    def __init__(self) -> None:
        self.wall = 1_000_000.0
        self.mono = 50.0


def test_a_wall_clock_step_does_not_move_the_daemons_time() -> None:
    c = Clocks()
    clock = SteadyClock(lambda: c.wall, lambda: c.mono)
    assert clock() == 1_000_000.0
    c.mono += 10
    c.wall += 86_400 + 10  # a day forward
    assert clock() == 1_000_010.0
    c.mono += 5
    c.wall -= 86_400 + 3600  # an hour back from where it was
    assert clock() == 1_000_015.0


def test_after_a_restart_the_daemons_time_starts_no_earlier_than_the_log() -> None:
    c = Clocks()
    clock = SteadyClock(lambda: c.wall - 3600, lambda: c.mono)  # the wall clock went back an hour
    clock.not_before(1_000_000.0)
    assert clock() == 1_000_000.0
    c.mono += 1
    assert clock() == 1_000_001.0
    clock.not_before(10.0)  # a floor in the past changes nothing
    assert clock() == 1_000_001.0


# --- a real daemon whose wall clock jumps -------------------------------------------


def _faketime_env(monkeypatch: pytest.MonkeyPatch, offset_file: Path) -> None:
    offset_file.write_text("+0\n")
    assert LIBFAKETIME is not None
    monkeypatch.setenv("LD_PRELOAD", LIBFAKETIME)
    monkeypatch.setenv("FAKETIME_TIMESTAMP_FILE", str(offset_file))
    monkeypatch.setenv("FAKETIME_NO_CACHE", "1")
    monkeypatch.setenv("FAKETIME_DONT_FAKE_MONOTONIC", "1")


def _log(state: Path) -> list[ev.Event]:
    return list(eventlog.read(state / "log"))


def _assert_times_ordered(events: list[ev.Event]) -> None:
    back = [(a.seq, a.ts, b.seq, b.ts) for a, b in itertools.pairwise(events) if b.ts < a.ts]
    assert not back, f"times go backwards in the log: {back[:3]}"


def _ran_for(events: list[ev.Event], job: int) -> float:
    start = next(e.ts for e in events if isinstance(e, ev.JobStarted) and e.job == job)
    end = next(e.ts for e in events if isinstance(e, ev.JobExited) and e.job == job)
    return end - start


@pytest.mark.slow
@needs_faketime
def test_a_day_forward_fires_no_time_limit_early_and_charges_no_day(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from daemon_harness import Daemon

    _faketime_env(monkeypatch, tmp_path / "offset")
    state = tmp_path / "state"
    with Daemon(state) as d:
        long = d.submit("--time-limit", "60", "--", "sleep", "120")
        short = d.submit("--time-limit", "5", "--", "sleep", "120")
        d.wait_states([long, short], {"running"}, 15)
        (tmp_path / "offset").write_text("+1d\n")
        began = time.monotonic()
        d.wait_states([short], {"failed"}, 30)
        assert time.monotonic() - began < 15
        time.sleep(1.0)
        assert d.jobs()[long]["state"] == "running", "a wall clock a day ahead killed a job 55 s before its limit"
        d.cli("cancel", str(long))
        d.wait_states([long], {"cancelled"}, 15)
        events = _log(state)
    _assert_times_ordered(events)
    assert 4.0 <= _ran_for(events, short) < 30.0, "a day of the wall clock was charged as run time"


@pytest.mark.slow
@needs_faketime
def test_an_hour_back_holds_no_time_limit_back_and_keeps_the_log_in_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from daemon_harness import Daemon

    _faketime_env(monkeypatch, tmp_path / "offset")
    state = tmp_path / "state"
    with Daemon(state) as d:
        job = d.submit("--time-limit", "4", "--", "sleep", "120")
        d.wait_states([job], {"running"}, 15)
        (tmp_path / "offset").write_text("-1h\n")
        d.wait_states([job], {"failed"}, 20)  # not an hour late
        after = d.submit("--", "true")  # recorded after the step: still later than what came before
        d.wait_states([after], {"succeeded"}, 15)
        events = _log(state)
    _assert_times_ordered(events)
    assert 3.0 <= _ran_for(events, job) < 20.0


@pytest.mark.slow
@needs_faketime
def test_times_stay_ordered_across_a_restart_with_the_wall_clock_an_hour_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from daemon_harness import Daemon

    _faketime_env(monkeypatch, tmp_path / "offset")
    state = tmp_path / "state"
    with Daemon(state) as d:
        d.wait_states([d.submit("--", "true")], {"succeeded"}, 15)
    (tmp_path / "offset").write_text("-1h\n")
    with Daemon(state) as d:
        d.wait_states([d.submit("--", "true")], {"succeeded"}, 15)
    _assert_times_ordered(_log(state))


# --- a suspend-like pause ----------------------------------------------------------------


@pytest.mark.slow
def test_a_paused_daemon_loses_and_doubles_nothing(tmp_path: Path) -> None:
    """SIGSTOP the daemon for 3 s while clients submit and jobs run, then SIGCONT:
    every acknowledged job is there once and ran once, a time limit that fell
    due during the pause fires, and the pause is no burst of GPU samples."""
    from daemon_harness import Daemon

    state = tmp_path / "state"
    ran = tmp_path / "ran"
    job_cmd = ["--", "sh", "-c", f'echo "$EVENTSCHED_JOB_ID" >> {ran}; sleep 0.5']
    with Daemon(state) as d:
        acked = [d.submit(*job_cmd) for _ in range(5)]
        limited = d.submit("--time-limit", "2", "--", "sleep", "60")
        d.wait_states([limited], {"running"}, 15)
        assert d.process is not None
        late: list[int] = []
        errors: list[str] = []

        def submit_during_pause() -> None:
            for _ in range(3):
                try:
                    late.append(d.submit(*job_cmd))
                except AssertionError as exc:
                    errors.append(str(exc))

        d.process.send_signal(signal.SIGSTOP)
        paused_at = time.time()
        client = threading.Thread(target=submit_during_pause)
        client.start()
        time.sleep(3.0)
        d.process.send_signal(signal.SIGCONT)
        client.join(60)
        assert not errors, errors
        acked += late
        d.wait_states(acked, {"succeeded"}, 60)
        d.wait_states([limited], {"failed"}, 15)
        assert d.process.poll() is None
        events = _log(state)
    submitted = [e.job for e in events if isinstance(e, ev.JobSubmitted)]
    assert sorted(submitted) == sorted([*acked, limited]), "a submission was lost or doubled"
    lines = ran.read_text().split()
    assert sorted(int(x) for x in lines) == sorted(acked), "a job ran twice or not at all"
    _assert_times_ordered(events)
    # the sampler sleeps between samples: a pause is not made up for with a burst
    samples_after = [e for e in events if isinstance(e, ev.GpuSampled) and paused_at <= e.ts <= paused_at + 4.0]
    assert len(samples_after) <= 4 * 4, f"{len(samples_after)} samples of 4 GPUs around a 3 s pause"
