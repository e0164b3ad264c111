"""Booked GPUs (``eventsched reserve``): the window logic in the pure core,
then end to end as real users against a root daemon on fake GPUs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from test_core import Sched, placed
from users_harness import User, as_user, needs_root, public_dir, root_daemon, third_user, users  # noqa: F401

from eventsched.core.explain import waiting_reason
from eventsched.core.forecast import forecast_starts
from eventsched.domain import events as ev
from eventsched.domain import messages as m
from eventsched.projections.cluster import snapshot_bytes, state_from_snapshot
from eventsched.sim.compare import compare_placements
from eventsched.sim.simulator import RECORDED, simulate
from eventsched.sim.sources import load_source

ALICE, BOB = 1001, 1002


def book(s: Sched, start: float, end: float, uid: int = ALICE, **kw: object) -> int:
    kw.setdefault("gpu_ids", [0, 1])
    msg = m.Reserve(start=start, end=end, user=f"u{uid}", uid=uid, by=f"uid:{uid}", **kw)  # type: ignore[arg-type]
    events, _ = s.do(msg)
    return next(e.reservation for e in events if isinstance(e, ev.ReservationCreated))


# --- the window, in the pure core ---------------------------------------------------


@pytest.mark.parametrize("policy", ["fifo", "priority", "best-fit", "fair-share", "sjf-backfill", "fgd"])
def test_booked_gpus_go_only_to_their_owner_during_the_window_and_to_short_jobs_before(policy: str) -> None:
    s = Sched(gpus=2, policy=policy)
    rid = book(s, start=200.0, end=300.0)
    long_job = s.submit(uid=BOB, time_limit_s=500.0, name="long")  # would still run at 200: stays off
    unknown = s.submit(uid=BOB, name="unknown")  # nothing predicts it: stays off too
    short = s.submit(uid=BOB, time_limit_s=50.0, name="short")  # ends by 150: may use them now
    assert s.st(long_job) == s.st(unknown) == "queued"
    assert s.st(short) == "running"
    reason = waiting_reason(s.state, long_job, s.now)
    assert reason is not None and reason.kind == "reserved"
    assert f"reserved for u{ALICE}" in reason.text and f"(reservation {rid})" in reason.text
    s.exit(short, at=150.0)
    assert s.st(long_job) == "queued"
    s.do(m.Tick(), at=200.0)  # the window opens
    mine = s.submit(uid=ALICE, gpus=2.0)
    assert s.st(mine) == "running" and s.on(mine) == [0, 1]
    assert s.st(long_job) == "queued"
    s.exit(mine, at=250.0)
    assert s.st(long_job) == "queued"  # still inside the window
    events, _ = s.do(m.Tick(), at=300.0)  # the window closes
    assert long_job in placed(events)


def test_the_core_wakes_at_the_window_edges_and_the_forecast_waits_for_them() -> None:
    s = Sched(gpus=2)
    book(s, start=200.0, end=300.0)
    job = s.submit(uid=BOB, time_limit_s=500.0)
    _, effects = s.do(m.Tick(), at=150.0)
    assert any(isinstance(e, m.WakeAt) and e.at == 200.0 for e in effects)
    start = forecast_starts(s.state, s.now, {job}).starts[job]
    assert start >= 300.0  # not before the window is over


def test_another_job_found_on_booked_gpus_when_the_window_opens_is_requeued_or_flagged() -> None:
    for policy, stopped in (("requeue", True), ("flag", False)):
        s = Sched(gpus=2, reservation_policy=policy)
        squatter = s.submit(uid=BOB, gpus=2.0)  # started before the booking existed
        book(s, start=200.0, end=300.0)
        events, effects = s.do(m.Tick(), at=200.0)
        stops = [e for e in events if isinstance(e, ev.JobCancelRequested)]
        assert bool(stops) == stopped, policy
        if stopped:
            assert stops[0].reason == "preempted" and stops[0].by.startswith("reservation ")
            assert any(isinstance(e, m.Signal) and e.job == squatter for e in effects)
            events, _ = s.exit(squatter, code=None, signal=15)
            assert any(isinstance(e, ev.JobRequeued) and e.job == squatter for e in events)
            assert s.st(squatter) == "queued"
        else:
            assert s.st(squatter) == "running"


def test_bookings_are_checked_limited_and_cancelled_only_by_their_owner_or_an_operator() -> None:
    s = Sched(gpus=4)
    rid = book(s, start=200.0, end=300.0, gpu_ids=None, gpus=2)
    assert s.state.reservations[rid].gpu_ids == [0, 1]
    clash = m.Reserve(start=250.0, end=400.0, user="u9", uid=9, gpu_ids=[1, 2])
    assert "reserved for u1001" in s.refused(clash)
    nxt = book(s, start=250.0, end=400.0, uid=BOB, gpu_ids=None, gpus=2)  # the other two
    assert s.state.reservations[nxt].gpu_ids == [2, 3]
    assert "free then" in s.refused(m.Reserve(start=260.0, end=270.0, uid=9, gpus=1))
    busy = s.submit(uid=BOB, gpus=2.0, name="busy")  # on bob's own booked GPUs; nothing predicts its end
    assert s.on(busy) == [2, 3]
    assert "runs job" in s.refused(m.Reserve(start=150.0, end=160.0, uid=9, gpu_ids=[2], limits=(2.0, 100.0)))
    assert "free then" in s.refused(m.Reserve(start=150.0, end=160.0, uid=9, gpus=3, limits=(2.0, 100.0)))
    too_far = m.Reserve(start=s.now + 10 * 3600, end=s.now + 11 * 3600, uid=9, gpus=1, limits=(2.0, 100.0))
    assert "max_hours_ahead" in s.refused(too_far)
    too_much = m.Reserve(start=1000.0, end=1000.0 + 3 * 3600, uid=9, gpu_ids=[0], limits=(2.0, 2.0))
    assert "max_gpu_hours" in s.refused(too_much)
    assert "only its owner" in s.refused(m.CancelReservation(reservation=rid, uid=BOB, operator=False, by=f"uid:{BOB}"))
    assert "no reservation" in s.refused(m.CancelReservation(reservation=99))
    events, _ = s.do(m.CancelReservation(reservation=rid, uid=ALICE, operator=False, by=f"uid:{ALICE}"))
    assert isinstance(events[0], ev.ReservationCancelled) and rid not in s.state.reservations


def test_reservations_survive_a_snapshot_and_replay_from_the_log() -> None:
    s = Sched(gpus=2)
    rid = book(s, start=200.0, end=300.0)
    again = state_from_snapshot(snapshot_bytes(s.state))
    assert again.reservations == s.state.reservations and again.last_reservation == rid
    decoded = ev.decode_many(ev.encode_many(s.log))
    assert [type(e) for e in decoded] == [type(e) for e in s.log]


@pytest.mark.parametrize("args,said", [
    (["--gpus", "2", "--gpu-ids", "0", "--start", "now", "--duration", "1h"], "either --gpus K or --gpu-ids"),
    (["--gpus", "2", "--start", "bogus", "--duration", "1h"], "--start 'bogus'"),
    (["--gpus", "2", "--start", "now", "--duration", "-1"], "--duration '-1'"),
    (["--gpus", "2", "--start", "now"], "--start WHEN --duration D"),
])
def test_bad_reserve_input_is_one_line_before_any_daemon_is_asked(args: list[str], said: str, tmp_path: Path) -> None:
    env = dict(os.environ, EVENTSCHED_STATE_DIR=str(tmp_path))
    out = subprocess.run([sys.executable, "-m", "eventsched.cli", "reserve", "create", *args], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and said in out.stderr and out.stderr.count("\n") == 1, out.stderr


# --- end to end: two real users against a root daemon on fake GPUs ---------------------

LEAD_S, WINDOW_S = 6.0, 8.0  # the window opens this long after booking, and lasts this long


def _ok(user: User, state: Path, *args: str) -> str:
    out = as_user(user, state, *args)
    assert out.returncode == 0, out.stderr
    return out.stdout


@pytest.mark.slow
@needs_root
def test_a_booked_window_holds_two_gpus_for_its_owner_against_another_user(
        users: tuple[User, User], third_user: User, public_dir: Path, tmp_path: Path) -> None:
    alice, bob = users
    d = root_daemon(public_dir, gpus="fake:3").start()
    state = d.state_dir
    try:
        # bob's job runs on GPU 0 before anything is booked: found there when the window opens
        squatter = int(_ok(bob, state, "submit", "--signal", "TERM@1", "--", "sleep", "120"))
        d.wait_states([squatter], {"running"})
        window = ("--start", f"+{LEAD_S:g}s", "--duration", f"{WINDOW_S:g}s")
        taken = as_user(alice, state, "reserve", "create", "--gpu-ids", "0,1", *window)  # a user books free GPUs
        assert taken.returncode != 0 and f"runs job {squatter} of {bob.name}" in taken.stderr
        booked = d.cli("reserve", "create", "--user", alice.name, "--gpu-ids", "0,1", *window, "--name", "deadline",
                       "--json")  # an operator may book them
        assert booked.returncode == 0, booked.stderr
        made = json.loads(booked.stdout)
        rid, opens = made["id"], made["start"]
        assert made["owner"] == alice.name and made["gpu_ids"] == [0, 1]
        # bob may neither book for alice nor cancel her booking: one line each
        for args in (("reserve", "create", "--user", alice.name, "--gpus", "1", "--start", "+1h", "--duration", "1h"),
                     ("reserve", "cancel", str(rid))):
            refused = as_user(bob, state, *args)
            assert refused.returncode != 0 and "Traceback" not in refused.stderr
            assert len(refused.stderr.strip().splitlines()) == 1, refused.stderr
        refused = as_user(third_user, state, "reserve", "cancel", str(rid))  # nor may anyone else
        assert refused.returncode != 0 and len(refused.stderr.strip().splitlines()) == 1, refused.stderr
        assert [r["id"] for r in json.loads(d.cli("reserve", "list", "--json").stdout)] == [rid]  # still there
        # bob's long job would run into the window: GPUs 1 and 2 are free, yet it waits
        long_job = int(_ok(bob, state, "submit", "--gpus", "2", "--time-limit", "1h", "--", "sleep", "120"))
        jobs = d.jobs()
        assert jobs[long_job]["state"] == "queued" and f"reserved for {alice.name}" in jobs[long_job]["reason"]
        assert f"(reservation {rid})" in _ok(bob, state, "explain", str(long_job))
        other = int(_ok(bob, state, "submit", "--", "sleep", "120"))  # fits on GPU 2
        mine = int(_ok(alice, state, "submit", "--gpus", "2", "--", "sleep", "2"))  # waits for GPU 0
        jobs = d.wait_states([other], {"running"})
        assert jobs[other]["gpu_ids"] == [2] and jobs[long_job]["state"] == "queued"
        assert "A = reservation" in _ok(bob, state, "reserve", "list", "--timeline")
        # the window opens: bob's job there is stopped and requeued, alice's starts on the two GPUs
        jobs = d.wait_states([mine], {"running", "succeeded"}, timeout=LEAD_S + 10)
        assert jobs[mine]["gpu_ids"] == [0, 1] and opens <= jobs[mine]["started_at"] < opens + 4
        new = int(_ok(bob, state, "submit", "--", "sleep", "120"))  # during the window: no booked GPU for bob
        d.wait_states([mine], {"succeeded"})
        jobs = d.jobs()
        assert jobs[squatter]["state"] == "queued" and jobs[squatter]["attempts"] == 1
        assert f"its GPUs are booked from now (reservation {rid})" in _ok(bob, state, "explain", str(squatter))
        assert all(jobs[j]["state"] == "queued" for j in (long_job, new)), jobs
        # the window closes: bob's jobs get the GPUs
        d.wait_for(lambda js: {g for j in (squatter, long_job, new) if js[j]["state"] == "running"
                               for g in js[j]["gpu_ids"]} == {0, 1}, WINDOW_S + 10, "bob's jobs on GPUs 0 and 1")
        d.cli("cancel", str(squatter), str(long_job), str(other), str(new))
        d.wait_states([squatter, long_job, other, new], {"cancelled"}, timeout=30)
    finally:
        d.stop()
    out = tmp_path / "replay"
    simulate(load_source(state), RECORDED, out)
    assert compare_placements(state / "log", out / "log") is None
