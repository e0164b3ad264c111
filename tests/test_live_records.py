"""The state's compiled GPU and job classes (projections/live.py) against the
snapshot's Structs derived from them: the same fields, types and defaults,
converted both ways without loss, and copies that do not share what changes
in place."""

from __future__ import annotations

import msgspec
import pytest

from eventsched.domain import events as ev
from eventsched.domain.states import JobState
from eventsched.projections.live import Gpu, Job
from eventsched.projections.records import GpuRecord, JobRecord


def _job_record() -> JobRecord:
    """Every field away from its default, so a field lost on the way shows."""
    spec = ev.JobSpec(command=["python", "train.py"], user="alice", gpus=2.0, priority=3)
    return JobRecord(
        id=7, spec=spec, state=JobState.RUNNING, count=2, milli=500, order=11, submitted_at=1.5, started_at=2.5,
        ended_at=3.5, exit_code=4, signal=9, reason="why", node="n2", gpu_ids=[1, 3], mem_mib=1024, policy="best-fit",
        pid=4242, start_time=99, log_path="/l", attempts=2, retries_used=1, not_before=5.5, cancel_reason="user",
        submitted_seq=17, queued_at=1.25, predicted_end=60.0, preemptions=1, gpu_mem_peak_mib=900, gpu_mem_over=True,
        idle_since=2.75,
    )


def _gpu_record() -> GpuRecord:
    return GpuRecord(
        node="n2", id=3, uuid="GPU-x", model="H100", memory_total_mib=81_920, paused=True, lost=True, error="xid",
        sampled_at=1.0, utilization=55.0, memory_used_mib=2048, temperature_c=61.0, power_w=300.0,
        foreign_memory_mib=12, used_milli=750, reserved_mib=4096, jobs=[7, 8], low_since=0.5,
        job_memory_mib={7: 1000}, foreign_processes=[ev.GpuProcess(pid=1, used_mib=12, uid=1000, user="bob")],
        paused_reason="Xid 79", health=ev.GpuHealth(node="n2", gpu=3, xids=[79]),
    )


def _defaults_differ(record: msgspec.Struct) -> None:
    default = type(record)
    for f in msgspec.structs.fields(default):
        if f.default is not msgspec.NODEFAULT:
            assert getattr(record, f.name) != f.default, f"the test leaves {f.name} at its default"


@pytest.mark.parametrize(("live", "make"), [(Job, _job_record), (Gpu, _gpu_record)])
def test_every_field_survives_both_conversions_and_a_copy(live: type, make: object) -> None:
    record = make()  # type: ignore[operator]
    _defaults_differ(record)
    obj = live.from_record(record)
    for f in msgspec.structs.fields(record):
        assert getattr(obj, f.name) == getattr(record, f.name), f.name
    assert obj.record() == record
    assert obj.copy().record() == record
    assert obj.copy() == obj


def test_the_records_are_the_declared_fields() -> None:
    for obj, record in ((Gpu.from_record(_gpu_record()), GpuRecord), (Job.from_record(_job_record()), JobRecord)):
        assert list(obj.values()) == [f.name for f in msgspec.structs.fields(record)]
    types = {f.name: f.type for f in msgspec.structs.fields(JobRecord)}
    assert types["state"] is JobState and types["started_at"] == float | None  # real types, as declared
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(_job_record()), type=JobRecord) == _job_record()
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(_gpu_record()), type=GpuRecord) == _gpu_record()


def test_defaults_match_the_records() -> None:
    spec = ev.JobSpec(command=["x"])
    assert Job(id=1, spec=spec).record() == JobRecord(id=1, spec=spec)
    assert Gpu(node="n", id=0).record() == GpuRecord(node="n", id=0)


def test_a_copy_shares_no_container_that_changes_in_place() -> None:
    gpu = Gpu.from_record(_gpu_record())
    twin = gpu.copy()
    twin.jobs.append(9)
    twin.job_memory_mib[9] = 1
    assert gpu.jobs == [7, 8] and 9 not in gpu.job_memory_mib
    job = Job.from_record(_job_record())
    other = job.copy()
    other.gpu_ids.append(5)
    assert job.gpu_ids == [1, 3]


def test_fresh_objects_do_not_share_their_default_containers() -> None:
    a, b = Gpu(node="n", id=0), Gpu(node="n", id=1)
    a.jobs.append(1)
    assert b.jobs == []
    spec = ev.JobSpec(command=["x"])
    j, k = Job(id=1, spec=spec), Job(id=2, spec=spec)
    j.gpu_ids.append(0)
    assert k.gpu_ids == []
