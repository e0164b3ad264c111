"""The catch-up from undecoded frames (history_frames, the C ``_frames``
walker) against the fold of decoded events (history_fold.fold): the same
rows, the same errors, on logs full of the cases the walker must get right or
hand back (odd numbers, omitted defaults, unknown keys and types, non-empty
nested fields, seq numbers that are not positions, broken frames).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import duckdb
import msgspec
import pytest

from eventsched.domain import events as ev
from eventsched.projections import history_fold as hf
from eventsched.projections import history_frames as hfr
from eventsched.projections.history import History, rebuild
from eventsched.projections.history_schema import TABLES
from eventsched.storage import log

needs_extension = pytest.mark.skipif(hfr._frames is None, reason="eventsched.projections._frames not built")

RAW_TABLES = ("job_events", "submissions", "placement_events", "gpu_samples", "gpu_events", "daemon_events",
              "tenant_configs", "forecasts", "_position")
T0 = 1_700_000_000.0
BIG = 2**64 - 1  # msgspec decodes up to here; the fold clamps to int64


def spec(**kw: Any) -> ev.JobSpec:
    return ev.JobSpec(**{"command": ["python", "train.py"], "user": "ann", **kw})


def sample(gpu: int, **kw: Any) -> ev.GpuSampled:
    base: dict[str, Any] = {"ts": T0, "node": "n1", "gpu": gpu, "utilization": 50.5, "memory_used_mib": 100,
                            "memory_total_mib": 80_000, "temperature_c": 40.0, "power_w": 300.0}
    return ev.GpuSampled(**{**base, **kw})


def typed_frames() -> list[list[ev.Event]]:
    """Events made as structs (every field written), of every kind the fold knows."""
    return [
        [ev.DaemonStarted(ts=T0, node="n1", pid=1, version="1", policy="fifo"),
         ev.GpuDiscovered(ts=T0, node="n1", gpu=0, uuid="GPU-0", model="H100", memory_total_mib=80_000),
         ev.TenantsConfigured(ts=T0, tenants={"ml": ev.Tenant(users=["ann"], gpus=2.0)}, by="root")],
        [ev.JobSubmitted(ts=T0 + 1, cause="uid:1000", job=1, spec=spec(gpus=0.25, after=[7, 8], gpu_ids=[])),
         ev.JobSubmitted(ts=T0 + 1, job=2, spec=spec(command=["echo", "hello world", "$HOME"], user="józef",
                                                    gpu_ids=[1, 2], time_limit_s=60.0, on_time_limit="requeue",
                                                    priority=2**63 - 1, retries=BIG, uid=-(2**63))),
         ev.JobSubmitted(ts=T0 + 1, job=3, spec=spec(command=["a"], env={"X": "1"}, rlimits={"nofile": [1, 2]},
                                                    gpus=1e16, name="x" * 300)),
         ev.JobSubmitted(ts=T0 + 1, job=4, spec=spec(command=["", "x"], gpus=float("nan"))),
         ev.JobSubmitted(ts=T0 + 1, job=5, spec=spec(gpus=float("nan"), time_limit_s=float("-inf"))),
         sample(0, utilization=float("nan"), power_w=float("inf")),
         ev.JobPlaced(ts=T0 + 2, job=1, node="n1", gpu_ids=[3, 1], share=0.25, gpu_mem_mib=10, policy="fgd"),
         ev.JobPlaced(ts=T0 + 2, job=2, node="n1", gpu_ids=[], share=-0.0),
         ev.JobStarted(ts=T0 + 3, job=1, pid=4242, start_time=5, log_path="/tmp/x"),
         sample(1, job_memory_mib={1: 100}, foreign_processes=[ev.GpuProcess(pid=9, used_mib=3)]),
         sample(2, foreign_memory_mib=BIG, memory_used_mib=-5),
         sample(7, job_memory_mib={1: 100, 2: 2**40, -1: 0}),
         ev.JobSubmitted(ts=T0 + 1, job=6, spec=spec(env={"PATH": "/bin", "É": "ü", "": ""}, groups=[1, 2],
                                                    rlimits={"nofile": [1024, -1], "core": []})),
         ev.JobForecast(ts=T0 + 3, job=2, estimated_start=T0 + 100),
         ev.TimerFired(ts=T0 + 3),
         ev.JobsCommanded(ts=T0 + 3, command="cancel", jobs=[2]),
         ev.JobCancelRequested(ts=T0 + 4, job=2, by="ann", reason="preempted", for_job=1, rule="priority")],
        [ev.JobExited(ts=T0 + 5, job=1, exit_code=None, signal=9, reason="cancelled"),
         ev.JobExited(ts=T0 + 5, job=2, exit_code=None),
         ev.JobExited(ts=T0 + 6, job=3, exit_code=-3, outcome="failed"),
         ev.JobExited(ts=T0 + 6, job=4, exit_code=0, reason="why not"),
         ev.JobRequeued(ts=T0 + 6, job=3, reason="retry", not_before=T0 + 60),
         ev.JobIdle(ts=T0 + 6, job=1, since=T0 + 2),
         ev.GpuPaused(ts=T0 + 7, node="n1", gpu=0, by="root"),
         ev.NodeJoined(ts=T0 + 7, node="n2"),
         sample(3)],
    ]


def raw_frames(first_seq: int) -> list[list[dict[str, Any]]]:
    """Events as the msgpack maps a writer could have made: omitted defaults,
    ints for floats, huge ints, keys in another order, unknown keys."""
    seq = first_seq

    def e(type_: str, **fields: Any) -> dict[str, Any]:
        nonlocal seq
        seq += 1
        return {"type": type_, "seq": seq - 1, **fields}

    gpu = {"node": "n1", "memory_total_mib": 80_000}
    frames = [
        [e("GpuSampled", gpu=4, utilization=50, memory_used_mib=BIG, temperature_c=-7, power_w=2**62, **gpu),
         e("GpuSampled", ts=T0 + 8, gpu=5, utilization=1.5, memory_used_mib=1, temperature_c=1.0, power_w=1.0,
           foreign_memory_mib=7, job_memory_mib={}, foreign_processes=[], cause="nvml", **gpu),
         e("GpuSampled", ts=T0 + 8, gpu=6, utilization=1.5, memory_used_mib=1, temperature_c=1.0, power_w=1.0,
           future_field={"a": [1]}, **gpu),
         e("JobSubmitted", ts=T0 + 9, job=10, spec={"command": ["x"]}),
         e("JobSubmitted", ts=T0 + 9, job=11, spec={"command": ["y"], "unknown": 1, "gpus": 2}),
         e("JobSubmitted", ts=T0 + 9, job=12, spec={"command": ["z"], "time_limit_s": 30, "gpu_ids": None}),
         e("JobPlaced", ts=T0 + 10, job=10, node="n1", gpu_ids=[0], share=1),
         e("JobStarted", ts=T0 + 10, job=10, pid=1),
         e("JobExited", ts=T0 + 11, job=10, exit_code=None),
         e("JobExited", ts=T0 + 11, job=11, exit_code=2**31 - 1, signal=-(2**31))],
    ]
    # "seq" before "type": msgspec finds the tag anyway; the walker hands it back
    moved = e("JobStarted", ts=T0 + 12, job=11, pid=2)
    frames.append([{"seq": moved.pop("seq"), **moved}, e("JobStarted", ts=T0 + 12, job=12, pid=3)])
    return frames


def put_frame(writer: log.LogWriter, payload: bytes, count: int) -> None:
    """A hand-made frame, durable: what no typed event can encode."""
    writer._put(log._frame_bytes(writer._salt, writer.next_seq, count, payload), count)
    writer.sync()


def append_raw(writer: log.LogWriter, events: list[dict[str, Any]]) -> None:
    payload = msgspec.msgpack.encode(events)
    put_frame(writer, payload, len(events))


def write_log(d: Path, extra: list[list[dict[str, Any]]] | None = None) -> int:
    """The typed frames, then the raw ones (and ``extra``, raw too); the last seq."""
    writer = log.LogWriter.open(d)
    try:
        for frame in typed_frames():
            writer.append(frame)
        for raw in raw_frames(writer.next_seq) + (extra or []):
            append_raw(writer, raw)
        return writer.next_seq - 1
    finally:
        writer.close()


def fresh() -> duckdb.DuckDBPyConnection:
    con = duckdb.connect(":memory:")
    hf.ensure_schema(con)
    return con


def rows(con: duckdb.DuckDBPyConnection) -> dict[str, list[str]]:
    """Every table: raw ones in their stored order, derived ones sorted (their
    order comes from parallel SQL); repr keeps NaN and -0.0 comparable."""
    out = {}
    for table in TABLES:
        order = "" if table in RAW_TABLES else " ORDER BY ALL"
        out[table] = [repr(r) for r in con.execute(f"SELECT * FROM {table}{order}").fetchall()]
    return out


def fold_both(d: Path, after: int = 0) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    old, new = fresh(), fresh()
    n_old = hf.fold(old, log.read_batches(d, after + 1), after)
    n_new = hfr.fold_frames(new, log.read_frames(d, after + 1), after)
    assert n_old == n_new
    return rows(old), rows(new)


@pytest.fixture
def same_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Both paths cut chunks at the same events, so raw tables match in order too."""
    monkeypatch.setattr(hfr, "CHUNK_EVENTS", hf.CHUNK_EVENTS)
    monkeypatch.setattr(hfr, "FIRST_CHUNK_EVENTS", hf.CHUNK_EVENTS)


@needs_extension
def test_odd_events_fold_as_decoded_ones(tmp_path: Path, same_chunks: None) -> None:
    write_log(tmp_path / "log")
    old, new = fold_both(tmp_path / "log")
    assert new == old
    assert len(old["gpu_samples"]) == 8 and len(old["submissions"]) == 9 and len(old["placement_events"]) == 3
    # the numbers the walker must get exactly as msgspec and the old fold do
    con = fresh()
    hfr.fold_frames(con, log.read_frames(tmp_path / "log"), 0)
    assert con.execute("SELECT memory_used_mib, utilization, power_w FROM gpu_samples WHERE gpu = 4").fetchall() == [
        (2**63 - 1, 50.0, float(2**62))]
    assert con.execute("SELECT retries, priority, uid FROM submissions WHERE job = 2").fetchall() == [
        (2**63 - 1, 2**63 - 1, -(2**63))]
    details = dict(con.execute("SELECT job, detail FROM job_events WHERE type = 'JobPlaced'").fetchall())
    assert details == {1: "node=n1 gpu_ids=3,1 share=0.25", 2: "node=n1 gpu_ids= share=-0",
                       10: "node=n1 gpu_ids=0 share=1"}
    # NaN is NULL (history_fold's pyarrow.array(..., from_pandas=True)); its detail says nan
    assert con.execute("SELECT job, gpus, detail FROM submissions JOIN job_events USING (job) "
                       "WHERE job IN (4, 5) AND type = 'JobSubmitted' ORDER BY job").fetchall() == [
        (4, None, "user=ann gpus=nan priority=0"), (5, None, "user=ann gpus=nan priority=0")]
    assert con.execute("SELECT utilization, power_w FROM gpu_samples WHERE gpu = 0").fetchall() == [(None, math.inf)]


@needs_extension
@pytest.mark.parametrize("cut", [1, 4, 5, 9, 20, 27, 30])
def test_after_seq_cutting_inside_a_frame(tmp_path: Path, same_chunks: None, cut: int) -> None:
    last = write_log(tmp_path / "log")
    assert cut < last
    old, new = fold_both(tmp_path / "log", after=cut)
    assert new == old
    assert old["_position"] == [repr((last, T0 + 12, hf.SCHEMA_VERSION))]


@needs_extension
def test_seq_that_is_not_the_position_goes_the_ordinary_way(tmp_path: Path, same_chunks: None) -> None:
    # a frame (valid checksum) whose events carry other seqs than their places:
    # the old fold keeps what the events say, and so must the new one
    writer = log.LogWriter.open(tmp_path / "log")
    try:
        writer.append([sample(0), sample(1)])
        first = writer.next_seq
        append_raw(writer, [ev.to_builtins(e) | {"seq": s} for e, s in
                            [(sample(2), first), (sample(3), first + 5), (sample(4), first - 2)]])
        append_raw(writer, [ev.to_builtins(sample(5)) | {"seq": first + 3},  # an odd one out of place
                            ev.to_builtins(sample(6, foreign_processes=[ev.GpuProcess(pid=1, used_mib=1)]))
                            | {"seq": first + 100}])
        writer.append([sample(7)])
    finally:
        writer.close()
    for after in (0, first, first + 1):
        old, new = fold_both(tmp_path / "log", after=after)
        assert new == old


@needs_extension
def test_many_chunks_and_transactions(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from bench.bench_history import synthetic_frames

    writer = log.LogWriter.open(tmp_path / "log")
    try:
        for frame in synthetic_frames(3_000):
            writer.append(frame)
        for frame in typed_frames():
            writer.append(frame)
        for raw in raw_frames(writer.next_seq):
            append_raw(writer, raw)
        for frame in synthetic_frames(2_000, seed=2):
            writer.append([msgspec.structs.replace(e, job=e.job + 10_000) if hasattr(e, "job") else e
                           for e in frame])
    finally:
        writer.close()
    monkeypatch.setattr(hf, "CHUNK_EVENTS", 700)
    monkeypatch.setattr(hf, "COMMIT_EVENTS", 2_000)
    monkeypatch.setattr(hfr, "CHUNK_EVENTS", 700)
    monkeypatch.setattr(hfr, "FIRST_CHUNK_EVENTS", 700)
    old, new = fold_both(tmp_path / "log")
    assert new == old
    # chunks of other sizes: the same rows (job_events in another order within chunks)
    monkeypatch.setattr(hfr, "CHUNK_EVENTS", 1_100)
    monkeypatch.setattr(hfr, "FIRST_CHUNK_EVENTS", 50)
    monkeypatch.setattr(hfr, "LAST_CHUNK_EVENTS", 300)
    _, other = fold_both(tmp_path / "log")
    assert {k: sorted(v) for k, v in other.items()} == {k: sorted(v) for k, v in old.items()}
    last = log.last_seq(tmp_path / "log")
    sizes = [c.count for c in hfr._chunks(log.read_frames(tmp_path / "log"), 0, last)]
    assert sum(sizes) == last
    # growing from the first, the last one small (each ends with a whole frame: up to ~80 events more)
    assert sizes[0] >= 50 and sizes[1] >= 125 and sizes[2] >= 312 and max(sizes) < 1_200, sizes
    assert 200 <= sizes[-1] < 400 and sizes[-2] < 1_100, sizes  # about LAST_CHUNK_EVENTS
    with_hint = fresh()
    hfr.fold_frames(with_hint, log.read_frames(tmp_path / "log"), 0, last)
    assert {k: sorted(v) for k, v in rows(with_hint).items()} == {k: sorted(v) for k, v in old.items()}


def failure(fold: Any) -> tuple[type, str, int]:
    con = fresh()
    with pytest.raises(Exception) as info:
        fold(con)
    return type(info.value), str(info.value), hf.position(con)


@needs_extension
@pytest.mark.parametrize("bad", [
    {"type": "GpuSampled", "node": "n", "gpu": True, "utilization": 1.0, "memory_used_mib": 1,
     "memory_total_mib": 1, "temperature_c": 1.0, "power_w": 1.0},
    {"type": "GpuSampled", "node": "n", "gpu": 1, "utilization": "1", "memory_used_mib": 1,
     "memory_total_mib": 1, "temperature_c": 1.0, "power_w": 1.0},
    {"type": "GpuSampled", "node": "n", "gpu": 1, "utilization": 1.0, "memory_used_mib": 1,
     "memory_total_mib": 1, "temperature_c": 1.0, "power_w": 1.0, "foreign_processes": [{"pid": "x"}]},
    {"type": "GpuSampled", "node": "n", "gpu": 1, "utilization": 1.0, "memory_used_mib": 1,
     "memory_total_mib": 1, "temperature_c": 1.0},  # power_w missing
    {"type": "GpuSampled", "node": "n", "gpu": 1, "utilization": 1.0, "memory_used_mib": 1.5,
     "memory_total_mib": 1, "temperature_c": 1.0, "power_w": 1.0},
    {"type": "JobExited", "job": 1},  # exit_code is required (None is a value)
    {"type": "JobSubmitted", "job": 1, "spec": {"command": ["x"], "on_time_limit": "never"}},
    {"type": "JobSubmitted", "job": 1, "spec": {"command": ["x"], "env": {"A": 1}}},
    {"type": "JobSubmitted", "job": 1, "spec": {"command": ["x"], "env": {"A": "b", "C": None}}},
    {"type": "JobSubmitted", "job": 1, "spec": {"command": ["x"], "rlimits": {"nofile": ["x"]}}},
    {"type": "JobSubmitted", "job": 1, "spec": {"command": ["x"], "rlimits": {"nofile": 5}}},
    {"type": "GpuSampled", "node": "n", "gpu": 1, "utilization": 1.0, "memory_used_mib": 1,
     "memory_total_mib": 1, "temperature_c": 1.0, "power_w": 1.0, "job_memory_mib": {"1": 2}},
    {"type": "GpuSampled", "node": "n", "gpu": 1, "utilization": 1.0, "memory_used_mib": 1,
     "memory_total_mib": 1, "temperature_c": 1.0, "power_w": 1.0, "job_memory_mib": {1: 2.5}},
    {"type": "JobPlaced", "job": 1, "node": "n", "gpu_ids": [1, None], "share": 1.0},
    {"type": "FutureEvent", "job": 1},
    {"type": 5},
    "not an event",
], ids=lambda bad: str(bad)[:40])
def test_a_frame_that_does_not_decode_fails_the_same_way(tmp_path: Path, bad: Any) -> None:
    writer = log.LogWriter.open(tmp_path / "log")
    try:
        writer.append([sample(0)])
        good = ev.to_builtins(sample(1)) | {"seq": writer.next_seq}
        if isinstance(bad, dict):
            bad = {**bad, "seq": writer.next_seq + 1}
        append_raw(writer, [good, bad, ev.to_builtins(sample(2)) | {"seq": writer.next_seq + 2}])
    finally:
        writer.close()
    assert_both_fail_alike(tmp_path / "log")


def assert_both_fail_alike(d: Path) -> None:
    """The frame walker and the fold of decoded frames raise the same error at the same place."""
    old = failure(lambda con: hf.fold(con, log.read_batches(d), 0))
    new = failure(lambda con: hfr.fold_frames(con, log.read_frames(d), 0))
    assert old[0] is log.LogCorruptError
    assert new == old


@needs_extension
@pytest.mark.parametrize("payload", [
    lambda evs: msgspec.msgpack.encode(evs) + b"\x00",  # trailing bytes
    lambda evs: msgspec.msgpack.encode(evs)[:-3],  # cut short
    lambda evs: b"\xc1",  # never used in msgpack
    lambda evs: msgspec.msgpack.encode({"a": evs}),  # not an array
])
def test_a_broken_payload_fails_the_same_way(tmp_path: Path, payload: Any) -> None:
    writer = log.LogWriter.open(tmp_path / "log")
    try:
        writer.append([sample(0)])
        evs = [ev.to_builtins(sample(1)) | {"seq": writer.next_seq}]
        data = payload(evs)
        put_frame(writer, data, 1)
    finally:
        writer.close()
    assert_both_fail_alike(tmp_path / "log")


@needs_extension
def test_an_integer_too_big_for_its_column_fails_the_same_way(tmp_path: Path) -> None:
    writer = log.LogWriter.open(tmp_path / "log")
    try:
        writer.append([sample(0), ev.JobExited(job=1, exit_code=2**40)])
    finally:
        writer.close()
    d = tmp_path / "log"
    old = failure(lambda con: hf.fold(con, log.read_batches(d), 0))
    new = failure(lambda con: hfr.fold_frames(con, log.read_frames(d), 0))
    assert issubclass(old[0], duckdb.Error)
    assert new[0] is old[0] and new[2] == old[2] == 0


def test_without_the_extension_frames_are_decoded_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_log(tmp_path / "log")
    reference = fresh()
    hf.fold(reference, log.read_batches(tmp_path / "log"), 0)
    monkeypatch.setattr(hfr, "_frames", None)
    assert not hfr.available()
    monkeypatch.setattr(hfr, "FrameChunk", None)  # never reached
    for after in (0, 5):
        con, expected = fresh(), fresh()
        hf.fold(expected, log.read_batches(tmp_path / "log", after + 1), after)
        hfr.fold_frames(con, log.read_frames(tmp_path / "log", after + 1), after)
        assert rows(con) == rows(expected)


def test_an_upcaster_turns_the_walker_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(ev.UPCASTERS, "OldShape", lambda e: e)
    assert not hfr.available()


@needs_extension
def test_the_plan_covers_the_common_events() -> None:
    _, where, _ = hfr._plan()
    assert set(where) == {ev.GpuSampled, ev.JobSubmitted, ev.JobPlaced, ev.JobStarted, ev.JobExited}


@needs_extension
def test_history_catches_up_from_frames(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    write_log(state / "log")
    reference = fresh()
    hf.fold(reference, log.read_batches(state / "log"), 0)
    assert rebuild(state) == hf.position(reference)
    with History(state).reader() as con:
        got = {t: sorted(v) for t, v in rows(con).items()}
    assert got == {t: sorted(v) for t, v in rows(reference).items()}


@needs_extension
def test_text_beyond_ascii(tmp_path: Path, same_chunks: None) -> None:
    writer = log.LogWriter.open(tmp_path / "log")
    try:
        writer.append([sample(0, node="nœud-é-😀"),
                       ev.JobSubmitted(job=1, spec=spec(user="józef", name="名前", tenant="ü", cwd="/tmp/ß")),
                       ev.JobExited(job=1, exit_code=1, reason="raison: é")])
    finally:
        writer.close()
    old, new = fold_both(tmp_path / "log")
    assert new == old
    assert any("józef" in r for r in new["submissions"])


@needs_extension
@pytest.mark.parametrize("bad", [b"\xc3\x28", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\xc0\xaf", b"\xe2\x82"])
def test_invalid_utf8_fails_the_same_way(tmp_path: Path, bad: bytes) -> None:
    writer = log.LogWriter.open(tmp_path / "log")
    try:
        good = ev.to_builtins(sample(1, node="ok")) | {"seq": writer.next_seq}
        marked = ev.to_builtins(sample(2, node="XXXX")) | {"seq": writer.next_seq + 1}
        payload = msgspec.msgpack.encode([good, marked]).replace(b"\xa4XXXX", bytes([0xa0 | len(bad)]) + bad)
        put_frame(writer, payload, 2)
    finally:
        writer.close()
    d = tmp_path / "log"
    old = failure(lambda con: hf.fold(con, log.read_batches(d), 0))
    new = failure(lambda con: hfr.fold_frames(con, log.read_frames(d), 0))
    # msgspec before 0.23 raised UnicodeDecodeError, which the log passes on; since then it is
    # a DecodeError, which the log reports as a damaged frame, with the repair command
    assert old[0] is (log.LogCorruptError if msgspec_decodes_bad_utf8_as_damage() else UnicodeDecodeError)
    assert new == old


def msgspec_decodes_bad_utf8_as_damage() -> bool:
    try:
        msgspec.msgpack.decode(b"\xa2\xc3\x28")
    except msgspec.DecodeError:
        return True
    except UnicodeDecodeError:
        return False
    raise AssertionError("msgspec decoded invalid UTF-8")
