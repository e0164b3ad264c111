"""The fast structures for a long backlog decide exactly as the plain ones do.

- ``SortedKeys`` (the blocked sorted list behind the queue's orders and the
  runtime history) holds, yields and finds the same keys as a list kept
  sorted with ``bisect``, through block splits and emptied blocks.
- The placement fast paths for a *plain* job (no memory request, no pinned
  GPUs or node) pick the same GPUs as the general path: the same request
  pinned to every GPU id takes the general path and must agree, for
  best-fit, first-fit and the fit test, on random multi-node free shares.
"""

from __future__ import annotations

import bisect
import math
from typing import Any

from hypothesis import example, given, settings
from hypothesis import strategies as st

from eventsched.core import policies
from eventsched.core.policies import View, best_fit, first_fit
from eventsched.domain import events as ev
from eventsched.domain.messages import SchedulerConfig
from eventsched.domain.states import JobState
from eventsched.domain.units import FULL
from eventsched.projections import model, sortedkeys
from eventsched.projections.cluster import Gpu, Job, request_of
from eventsched.projections.model import Capacity
from eventsched.projections.sortedkeys import SortedKeys

# --- SortedKeys ------------------------------------------------------------------

ops = st.lists(st.tuples(st.booleans(), st.integers(0, 60)), max_size=400)


@settings(max_examples=300, deadline=None)
@given(ops)
def test_sorted_keys_match_a_sorted_list(steps: list[tuple[bool, int]]) -> None:
    old = sortedkeys.LOAD
    sortedkeys.LOAD = 4  # tiny blocks: splits and emptied blocks on every run
    try:
        keys: SortedKeys[int] = SortedKeys()
        ref: list[int] = []
        for add, k in steps:
            if add:
                keys.add(k)
                bisect.insort(ref, k)
            else:
                present = k in ref
                assert keys.remove(k) == present
                if present:
                    ref.remove(k)
            assert len(keys) == len(ref)
            assert list(keys) == ref
            assert keys == ref and bool(keys) == bool(ref)
        for i in range(len(ref)):
            assert keys[i] == ref[i]
        if ref:
            assert keys[-1] == ref[-1]
        assert SortedKeys(ref) == keys
    finally:
        sortedkeys.LOAD = old


def test_sorted_keys_rebuilt_from_unsorted_input() -> None:
    keys = SortedKeys([(2, 1), (0, 5), (1, 3)])
    assert list(keys) == [(0, 5), (1, 3), (2, 1)]
    assert not keys.remove((9, 9)) and len(keys) == 3


# --- plain fast paths against the general path ---------------------------------


def _view(nodes: list[list[int]]) -> View:
    """A view of GPUs on several nodes with the given free shares."""
    gpus = [Gpu(node=f"n{n}", id=gid, memory_total_mib=81_920, used_milli=FULL - free)
            for n, shares in enumerate(nodes) for gid, free in enumerate(shares)]
    return View(Capacity(gpus, SchedulerConfig()), "n0")


def _job(gpus: float, pinned_to: list[int] | None = None) -> Job:
    spec = ev.JobSpec(command=["x"], gpus=gpus, gpu_ids=pinned_to)
    count, milli = request_of(spec)
    return Job(id=1, spec=spec, count=count, milli=milli)


shares = st.sampled_from([0, 0, 125, 250, 500, 750, 875, FULL, FULL])
clusters = st.lists(st.lists(shares, min_size=1, max_size=9), min_size=1, max_size=4)
requests = st.sampled_from([0.125, 0.25, 0.5, 0.75, 1, 2, 3, 4, 8])


@settings(max_examples=500, deadline=None)
@given(clusters, requests)
def test_plain_fast_paths_choose_as_the_general_path(nodes: list[list[int]], gpus: float) -> None:
    view = _view(nodes)
    plain = _job(gpus)
    # pinned to every GPU id: the same request, through the general path
    general = _job(gpus, sorted(set(view.id)))
    assert policies._plain(plain) and not policies._plain(general)
    assert best_fit(view, plain) == best_fit(view, general)
    assert first_fit(view, plain) == first_fit(view, general)
    assert policies._fits(view, plain) == policies._fits(view, general)
    assert policies._fits(view, plain) == (best_fit(view, general) is not None)
    need = plain.milli
    assert view.candidates(plain) == [i for i, f in enumerate(view.free) if f >= need]


def test_ended_array_tasks_are_counted_as_they_end_and_after_a_reload() -> None:
    """`queue` folds an array into "N done" from a count kept as tasks end
    (rather than by walking every task of the array for each page)."""
    from eventsched import core
    from eventsched.domain.messages import (
        Cancel,
        PauseGpu,
        ProcessExited,
        SchedulerConfig,
        Started,
        Submit,
    )
    from eventsched.projections.cluster import (
        ClusterState,
        snapshot_bytes,
        state_from_snapshot,
        validate_state,
    )
    from eventsched.runtime.gpus import FakeBackend

    state = ClusterState()
    backend = FakeBackend(2)
    steps: list[Any] = [
        Started(node="local", pid=1, version="t", gpu_backend=backend.name, gpus=backend.discover(),
                config=SchedulerConfig()),
        Submit(spec=ev.JobSpec(command=["true"], gpus=1, uid=0, user="root"), array=[0, 1, 2, 3, 4]),
        PauseGpu(node="local", gpu=1),
    ]
    for i, message in enumerate(steps):
        core.handle(state, message, 1.0 + i)
    array_id = next(j.spec.array_id for j in state.jobs.values())
    running = [j.id for j in state.jobs.values() if j.state == JobState.RUNNING]
    assert state.array_ended[array_id] == 0
    core.handle(state, ProcessExited(job=running[0], exit_code=0), 10.0)  # one ends, the next starts
    core.handle(state, Cancel(jobs=[array_id + 4], uid=0), 11.0)  # one queued task cancelled
    assert state.array_ended[array_id] == 2
    validate_state(state)  # equals a count from scratch
    assert state_from_snapshot(snapshot_bytes(state)).array_ended[array_id] == 2


# --- shortest-job-first: the lanes kept in step across decisions ----------------

# neighbours with no float between them: a key that moves in between refiles every job
PREDICTIONS = [60.0, 600.0, math.nextafter(600.0, math.inf), 600.5, 601.0, 3600.0]
lane_ops = st.lists(st.tuples(st.integers(0, 2), st.integers(0, 12), st.sampled_from([0.25, 1.0]),
                              st.integers(-1, 1), st.sampled_from("abc"),
                              st.sampled_from(PREDICTIONS), st.booleans()), max_size=120)


@settings(max_examples=300, deadline=None)
@given(lane_ops)
@example([(2, 0, 1.0, 0, "a", 600.0, False), (2, 0, 1.0, 0, "b", PREDICTIONS[2], False),
          (0, 1, 1.0, 0, "a", 0.0, False), (0, 2, 1.0, 0, "b", 0.0, True),  # labelled by their predictions
          (2, 0, 1.0, 0, "b", 601.0, True),  # b keeps its label, a float above a's
          (2, 0, 1.0, 0, "c", 600.5, False), (0, 3, 1.0, 0, "c", 0.0, True)])  # c between them: no float left
def test_sjf_lanes_kept_in_step_equal_a_sort_from_scratch(
        steps: list[tuple[int, int, float, int, str, float, bool]]) -> None:
    """Jobs entering and leaving, predictions moving past, onto and off each
    other's (a decision's ``sync`` after some steps): every shape's lane holds
    its jobs in (-priority, prediction, order) order, as sorting them anew does."""
    q = model.QueueIndex()
    lanes = q.listener = policies._SjfLanes(q)
    jobs: dict[int, Job] = {}
    preds: dict[str, float] = {}
    for step, (op, jid, gpus, prio, name, pred, decide) in enumerate(steps):
        if op == 0 and jid not in jobs:
            spec = ev.JobSpec(command=["x"], gpus=gpus, priority=prio, name=name)
            count, milli = request_of(spec)
            jobs[jid] = Job(id=jid, spec=spec, count=count, milli=milli, order=step)
            q.add(jobs[jid])
        elif op == 1 and jid in jobs:
            q.remove(jobs.pop(jid))
        elif op == 2:
            preds[name] = pred
        if decide:
            now = {r: preds.get(r[1], 3600.0) for r in q.by_rkey}
            lanes.sync(now)
            expected: dict[Any, list[int]] = {}
            for key in sorted((-j.spec.priority, now[model.runtime_key(j.spec)], j.order, j.id) for j in jobs.values()):
                expected.setdefault(q.shape_of[key[3]], []).append(key[3])
            assert {s: [k[3] for k in lane] for s, lane in lanes.lanes.items()} == expected


def test_iter_from_crosses_blocks() -> None:
    keys = SortedKeys(range(0, 5_000, 2))  # several blocks
    assert list(keys.iter_from(1_001)) == list(range(1_002, 5_000, 2))
    assert list(keys.iter_from(1_002)) == list(range(1_002, 5_000, 2))
    assert list(keys.iter_from(1_002, after=True)) == list(range(1_004, 5_000, 2))
    assert list(keys.iter_from(10_000)) == [] and list(keys.iter_from(-1)) == list(range(0, 5_000, 2))


# --- the queue's orders built on demand --------------------------------------------

queue_ops = st.lists(st.tuples(st.booleans(), st.integers(0, 40), st.sampled_from([0, 0.25, 0.5, 1.0, 2.0]),
                               st.integers(-1, 1), st.sampled_from(["a", "b"])), max_size=120)


@settings(max_examples=150, deadline=None)
@given(queue_ops, st.integers(0, 120), st.integers(0, 120))
def test_orders_built_on_demand_equal_orders_kept_from_the_start(
        steps: list[tuple[bool, int, float, int, str]], orders_at: int, groups_at: int) -> None:
    """A queue asked for its priority and submission orders and its runtime
    groups at some point, then kept in step, holds exactly what a queue that
    builds them only at the end does, and what sorting the jobs gives."""
    late, early = model.QueueIndex(), model.QueueIndex()
    jobs: dict[int, Job] = {}
    for step, (add, jid, gpus, prio, name) in enumerate(steps):
        if step == orders_at:
            assert early.by_priority == sorted(early.by_priority)  # built now, kept in step after
            assert len(early.by_order) == len(jobs)
        if step == groups_at:
            assert sum(map(len, early.by_rkey.values())) == len(jobs)
        if add and jid not in jobs:
            count, milli = request_of(ev.JobSpec(command=["x"], gpus=gpus))
            job = Job(id=jid, spec=ev.JobSpec(command=["x"], gpus=gpus, priority=prio, name=name),
                      count=count, milli=milli, order=step)
            jobs[jid] = job
            late.add(job)
            early.add(job)
        elif not add and jid in jobs:
            job = jobs.pop(jid)
            late.remove(job)
            early.remove(job)
        # the smallest share asked, kept between changes
        assert early.min_milli() == min((j.milli for j in jobs.values()), default=FULL + 1)
    expected = sorted((-j.spec.priority, j.order, j.id) for j in jobs.values())
    assert len(late) == len(early) == len(jobs)
    assert list(late.by_priority) == list(early.by_priority) == expected
    assert list(late.by_order) == list(early.by_order) == sorted((j.order, j.id) for j in jobs.values())
    assert late.by_rkey == early.by_rkey
    assert late.shape_rkey == early.shape_rkey
    assert {r: list(keys) for r, keys in late.by_rkey.items()} == {
        r: sorted(k for k in expected if model.runtime_key(jobs[k[2]].spec) == r)
        for r in {model.runtime_key(j.spec) for j in jobs.values()}}


# --- the records' methods, compiled in model -----------------------------------

opt_int = st.none() | st.integers(0, 90_000)


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 81_920), opt_int, st.integers(-1, 90_000), st.integers(0, 90_000))
def test_free_memory_of_is_what_neither_we_nor_others_hold(
    total: int, used: int | None, foreign: int, reserved: int
) -> None:
    gpu = Gpu(node="n", id=0, memory_total_mib=total, memory_used_mib=used, foreign_memory_mib=foreign,
              reserved_mib=reserved)
    # foreign = -1: nothing known of other processes, all observed use is ours
    others = max(foreign, 0)
    ours = (used or 0) - others if foreign >= 0 else (used or 0)
    expected = total - others - max(reserved, ours, 0)
    assert model.free_memory_of(gpu) == expected


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(["", "a", "default"]), st.none() | st.lists(st.integers(0, 7), max_size=3),
       st.sampled_from(["", "n1"]), st.integers(0, 3), st.integers(0, 2), st.integers(0, 1000))
def test_tenant_of_and_shape_of_equal_the_job_properties(
    tenant: str, ids: list[int] | None, node: str, array_id: int, array_cap: int, mem: int
) -> None:
    spec = ev.JobSpec(command=["x"], gpus=0.5, uid=0, user="u", tenant=tenant, gpu_ids=ids, node=node,
                      array_id=array_id, array_cap=array_cap, gpu_mem_mib=mem)
    job = Job(id=1, spec=spec, count=1, milli=500)
    assert model.tenant_of(job) == job.tenant
    assert model.shape_of(job) == job.shape


# --- the largest free share and the most whole GPUs, kept on the view ------------

view_ops = st.lists(st.tuples(st.booleans(), st.lists(st.integers(0, 40), max_size=4, unique=True),
                              st.sampled_from([0, 125, 250, 500, FULL])), max_size=30)


@settings(max_examples=300, deadline=None)
@given(clusters, view_ops, st.lists(st.tuples(st.integers(0, 40), shares), max_size=10))
def test_kept_maxima_equal_the_plain_computation(
    nodes: list[list[int]], steps: list[tuple[bool, list[int], int]], changes: list[tuple[int, int]]
) -> None:
    view = _view(nodes)
    cap = view.cap
    for i, free in changes:  # the projection's updates of the capacity between decisions
        if i < len(cap.free):
            cap.set_gpu(i, free, cap.mem[i])
        assert cap.max_free() == max(cap.free)
    view = View(cap, "n0")

    def whole(v: View) -> int:
        return max(v.free[idxs[0]:idxs[-1] + 1].count(FULL) for idxs in v.node_idx.values())

    for take, idxs, milli in steps:
        idxs = [i for i in idxs if i < len(view.free)]
        if take:
            idxs = [i for i in idxs if view.free[i] >= milli]
            view.take(idxs, milli, 0)
        else:
            idxs = [i for i in idxs if view.free[i] + milli <= FULL]
            view.give(idxs, milli, 0)
        assert view.max_free() == max(view.free)
        assert view.most_whole() == whole(view)
        copy = view.copy()
        assert copy.max_free() == max(view.free) and copy.most_whole() == whole(view)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from([0, 125, 250, 500, 750, FULL]), max_size=70), st.sampled_from([1, 125, 250, 500, FULL]),
       st.integers(0, 70), st.integers(0, 70))
def test_free_share_scans_equal_the_builtins(free: list[int], need: int, lo: int, hi: int) -> None:
    assert policies._all_at(free, need) == [i for i in range(len(free)) if free[i] == need]
    assert policies._max_of(free) == (max(free) if free else 0)
    assert policies._first_at_least(free, need) == next((i for i, f in enumerate(free) if f >= need), -1)
    lo, hi = min(lo, len(free)), min(hi, len(free))
    assert policies._count_at(free, lo, hi, FULL) == free[lo:hi].count(FULL)
    levels = sorted(set(f for f in free if f >= need))  # the least share that still fits, its first GPU
    assert policies._tightest_one(free, need) == ([free.index(levels[0])] if levels else None)


# --- a whole-GPU gang's reservation on the free shares alone ----------------------

running_st = st.lists(st.tuples(st.integers(0, 3), st.integers(0, 8), st.sampled_from([0.25, 0.5, 1, 2, 3]),
                                st.sampled_from([10.0, 20.0, 30.0, 40.0])), max_size=24)


@settings(max_examples=400, deadline=None)
@given(st.lists(st.integers(2, 8), min_size=1, max_size=3), running_st, st.sampled_from([2, 3, 4, 8]))
def test_whole_gang_reservation_equals_the_general_path(
    sizes: list[int], running: list[tuple[int, int, float, float]], k: int
) -> None:
    """Jobs placed on a cluster that starts all free, ending in some order: the
    plain head of ``k`` whole GPUs gets the shadow and GPUs that the same
    request pinned to every GPU id (the general path) gets."""
    view = _view([[FULL] * n for n in sizes])
    ends: list[tuple[float, int, list[int], int, int]] = []
    for jid, (node, first, gpus, end) in enumerate(running):
        count, milli = request_of(ev.JobSpec(command=["x"], gpus=gpus))
        on = view.node_idx.get(f"n{node % len(sizes)}", [])
        idxs = [i for i in on[first % len(on):] if view.free[i] >= milli][:count]
        if len(idxs) == count:
            view.take(idxs, milli, 0)
            ends.append((end, jid, idxs, milli, 0))
    ends.sort(key=lambda e: (e[0], e[1]))
    plain = _job(k)
    general = _job(k, sorted(set(view.id)))
    assert policies._plain(plain) and not policies._plain(general)
    expected = policies._reservation(view, general, ends, ordered=True)
    assert policies._reservation(view, plain, ends, ordered=True) == expected
    assert policies._reservation(view, plain, list(reversed(ends))) == expected


# --- the runtime history, its runs sorted in when asked ----------------------------

history_ops = st.lists(st.one_of(st.tuples(st.just("add"), st.sampled_from(["a", "b"]), st.floats(0, 100)),
                                 st.tuples(st.just("median"), st.just(""), st.just(0.0)),
                                 st.tuples(st.just("sorted"), st.just(""), st.just(0.0))), max_size=80)


@settings(max_examples=300, deadline=None)
@given(history_ops)
def test_runtime_history_equals_a_list_kept_sorted(steps: list[tuple[str, str, float]]) -> None:
    stats = model.RuntimeStats()
    ref: list[int] = []
    for op, name, runtime in steps:
        if op == "add":
            stats.add(("u", name), runtime)
            bisect.insort(ref, max(0, round(runtime * 1000)))
        elif op == "median":  # runs added since the last question are sorted in now
            m = len(ref) // 2
            median = None if not ref else (ref[m] if len(ref) % 2 else (ref[m - 1] + ref[m]) / 2) / 1000
            assert stats.predict(("u", "never"), 7.0) == (7.0 if median is None else median)
            assert stats.median() == median
        else:
            assert stats.sorted == ref
    assert stats.sorted == ref
