"""Every state a power cut can leave the log and the snapshots in, recovered.

A real run (the real core's events, group commits, segment rotations, three
snapshots) goes through ``crash_fs.Recorder``, which writes down each write,
fdatasync, rename, directory fsync and unlink. ``crash_fs.crash_states`` builds
from that record every state a power cut after each operation could leave
(unsynced writes dropped, cut at every byte, only their later part landed,
zero-filled, landing in any subset; unsynced directory entries as any prefix). Each one is written to a
fresh directory and recovered the way ``eventsched log verify`` and the daemon
(``LogWriter.open``, newest snapshot + the log's tail) do it.

A power cut during recovery itself (cutting a torn tail) is enumerated the
same way: recovering again gives the same events, and the cut bytes are kept
aside whenever the cut is on disk.

The quick tests sample the byte cuts (every 23rd byte) of a short run; the
slow one cuts every byte of a longer run (the counts are printed):

    EVENTSCHED_CRASH_EVERY_BYTE=1 .venv/bin/python -m pytest tests/test_crash_states.py -m slow -s
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import pytest

from eventsched import core
from eventsched.domain import events as ev
from eventsched.domain.messages import (
    GpuInfo,
    GpuObserved,
    Message,
    SchedulerConfig,
    Started,
    Submit,
)
from eventsched.projections import snapshot
from eventsched.projections.cluster import ClusterState, apply
from eventsched.storage import log as L
from eventsched.storage import logtools, snapshots
from crash_fs import SCRATCH, CrashState, Recorder, crash_states, materialize

Files = tuple[tuple[str, bytes], ...]  # a folder's (path, bytes), sorted: a crash state's key


@dataclass
class Run:
    """What a recorded run did, and when (in operations) each thing was acknowledged."""

    rec: Recorder
    written: list[ev.Event] = field(default_factory=list)  # every event appended, by seq
    acks: list[tuple[int, int]] = field(default_factory=list)  # (ops done when append returned, last seq)
    snaps: list[tuple[int, int]] = field(default_factory=list)  # (ops done when save returned, seq)
    snap_bytes: dict[int, bytes] = field(default_factory=dict)
    folded: dict[int, bytes] = field(default_factory=dict)  # n -> the first n events folded from scratch

    def folded_bytes(self, n: int) -> bytes:
        """The first ``n`` written events folded from an empty state, once per
        ``n`` (thousands of crash states share a handful of lengths)."""
        if n not in self.folded:
            whole = ClusterState()
            for e in self.written[:n]:
                apply(whole, e)
            whole.last_seq = n
            self.folded[n] = snapshot.snapshot_bytes(whole)
        return self.folded[n]


def _messages(commits: int) -> list[list[Message]]:
    """Batches of what a daemon's inbox holds: submissions and GPU samples."""
    gpus = [GpuInfo(gpu=i, uuid=f"u{i}", model="m", memory_total_mib=40960) for i in range(2)]
    started = Started(node="local", pid=1, version="t", gpu_backend="fake:2", gpus=gpus, config=SchedulerConfig())
    batches: list[list[Message]] = [[started]]
    for c in range(commits - 1):
        batch: list[Message] = [
            Submit(spec=ev.JobSpec(command=["python", "train.py", f"--seed={c}-{k}"], uid=1000, user="alice",
                                   gpus=0.5, cwd="/home/alice"), by="uid:1000")
            for k in range(1 + c % 3)
        ]
        batch.append(GpuObserved(node="local", gpu=c % 2, utilization=float(10 * c % 100), memory_used_mib=100 * c,
                                 memory_total_mib=40960, temperature_c=40.0 + c, power_w=100.0))
        batches.append(batch)
    return batches


def record_run(root: Path, commits: int, segment_bytes: int) -> Run:
    """Append ``commits`` group commits through a recorder, rotating segments
    and taking three snapshots (the third prunes the first)."""
    (root / "log").mkdir(parents=True)
    (root / "snapshots").mkdir()
    run = Run(Recorder(root))
    # zeros written ahead a few frames at a time (not the production MiB):
    # commits into them, growth past them and sealing all happen, and every
    # byte of every write stays enumerable
    w = L.LogWriter.open(root / "log", segment_bytes=segment_bytes, ops=run.rec, preallocate=600)
    state = ClusterState()
    now = 1000.0
    for i, batch in enumerate(_messages(commits)):
        produced: list[ev.Event] = []
        for msg in batch:
            events, _ = core.handle(state, msg, now)
            produced.extend(events)
        now += 1.5
        if not produced:
            continue
        stamped = w.append_stamped(produced)
        state.last_seq = stamped[-1].seq
        run.written.extend(stamped)
        run.acks.append((run.rec.mark(), state.last_seq))
        if i in (commits // 4, commits // 2, 3 * commits // 4):  # the third prunes the first
            data = snapshot.snapshot_bytes(state)
            snapshots.save_bytes(root / "snapshots", state.last_seq, data, ops=run.rec)
            run.snap_bytes[state.last_seq] = data
            run.snaps.append((run.rec.mark(), state.last_seq))
    w.close()
    assert len(L.segments(root / "log")) >= 3, "the run must rotate segments"
    assert [r.seq for r in run.written] == list(range(1, len(run.written) + 1))
    return run


def distinct_states(run: Run, byte_step: int) -> list[CrashState]:
    """Every state after every prefix of the operations, each kept once (with
    the latest cut that can produce it: the strongest expectation)."""
    seen: dict[Files, CrashState] = {}
    for cut in range(len(run.rec.ops) + 1):
        for state in crash_states(run.rec, cut, byte_step=byte_step):
            seen[state.key()] = state
    return list(seen.values())


def _verify(directory: Path) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = logtools.verify(directory)
    return code, err.getvalue()


class LogOutcome(NamedTuple):
    """What `log verify`, recovery and a read make of one log folder's bytes."""

    verified: tuple[int, str]
    refused: str  # recovery's refusal ("" when it recovered)
    next_seq: int
    events: list[ev.Event]
    verified_after: tuple[int, str]


def recover_log(log_dir: Path) -> LogOutcome:
    verified = _verify(log_dir)
    try:
        w = L.LogWriter.open(log_dir)
    except L.LogError as exc:
        return LogOutcome(verified, str(exc), 0, [], (0, ""))
    next_seq = w.next_seq
    w.close()
    return LogOutcome(verified, "", next_seq, list(L.read(log_dir)), _verify(log_dir))


class Loaded(NamedTuple):
    """What the daemon's start-up loads from one snapshots folder's bytes."""

    payload: bytes | None  # the newest valid snapshot's payload; None: none loaded
    last_seq: int
    matches: bool  # it is byte for byte the one saved at its seq


def load(run: Run, snap_dir: Path, decoded: dict[bytes, Loaded]) -> Loaded:
    """snapshot.load_latest's own steps, keeping the payload it decoded;
    ``decoded``: payloads already decoded (a pure function of their bytes)."""

    def decode(payload: bytes) -> Loaded:
        if payload not in decoded:
            state = snapshot.state_from_snapshot(payload)
            same = snapshot.snapshot_bytes(state) == run.snap_bytes.get(state.last_seq)
            decoded[payload] = Loaded(payload, state.last_seq, same)
        return decoded[payload]

    return snapshots.load_latest(snap_dir, decode, lambda got: got.last_seq) or Loaded(None, 0, True)


def resumes(run: Run, payload: bytes | None, n: int) -> bool:
    """Snapshot + the first ``n`` written events after it, folded == those ``n`` folded from scratch."""
    state = snapshot.state_from_snapshot(payload) if payload is not None else ClusterState()
    for e in run.written[state.last_seq : n]:
        apply(state, e)
    state.last_seq = n
    return snapshot.snapshot_bytes(state) == run.folded_bytes(n)


@dataclass
class Outcomes:
    """Outcomes already seen, each worked out once: thousands of crash states
    share them. A log's depends on its folder's bytes alone (with whether its
    events are the ones written); what start-up loads, on the snapshots'
    bytes alone, and a snapshot's decoding on its payload alone; the fold
    after it, on that payload and the log's length."""

    logs: dict[Files, tuple[LogOutcome, bool]] = field(default_factory=dict)
    loads: dict[Files, Loaded] = field(default_factory=dict)
    decoded: dict[bytes, Loaded] = field(default_factory=dict)
    folds: dict[tuple[bytes | None, int], bool] = field(default_factory=dict)


def _files(state: CrashState, folder: str) -> Files:
    return tuple(sorted((k, v) for k, v in state.files.items() if k.startswith(folder)))


def _fresh(state: CrashState, work: Path, folder: str) -> Path:
    """``state``'s files under ``folder`` alone, written to an empty ``work/folder``."""
    shutil.rmtree(work / folder, ignore_errors=True)
    (work / folder).mkdir(parents=True)
    materialize(state, work, folder + "/")
    return work / folder


def check_state(run: Run, state: CrashState, work: Path, seen: Outcomes | None = None) -> None:
    """Recover one crash state as `log verify` and the daemon do; assert
    nothing acknowledged is lost and nothing unwritten is accepted."""
    seen = seen if seen is not None else Outcomes()
    acked = max((seq for mark, seq in run.acks if mark <= state.cut), default=0)
    snapped = max((seq for mark, seq in run.snaps if mark <= state.cut), default=0)
    where = f"crash state after op {state.cut} ({state.how})"

    log_files = _files(state, "log/")
    if log_files not in seen.logs:
        out = recover_log(_fresh(state, work, "log"))
        seen.logs[log_files] = out, out.events == run.written[: len(out.events)]
    outcome, written_prefix = seen.logs[log_files]
    code, err = outcome.verified
    assert "damaged" not in err, f"{where}: log verify calls a crash state damaged: {err}"
    assert code == 0 or "torn tail" in err or "no log segments" in err, f"{where}: {err}"
    assert not outcome.refused, f"{where}: recovery refused a state a power cut can leave: {outcome.refused}"
    n = len(outcome.events)
    assert n == outcome.next_seq - 1, where
    assert n >= acked, f"{where}: events {n + 1}..{acked} were acknowledged and are gone"
    assert written_prefix, f"{where}: recovery accepted events that were never written"
    code, err = outcome.verified_after
    assert code == 0, f"{where}: log verify after recovery: {err}"

    # the daemon's start-up: newest valid snapshot + the log's tail == the whole log folded
    snap_files = _files(state, "snapshots/")
    if snap_files not in seen.loads:
        seen.loads[snap_files] = load(run, _fresh(state, work, "snapshots"), seen.decoded)
    loaded = seen.loads[snap_files]
    if loaded.payload is not None:
        assert loaded.last_seq <= n, f"{where}: a snapshot is ahead of the log"
        assert loaded.matches, where
    assert loaded.last_seq >= snapped, f"{where}: an acknowledged snapshot is gone"
    if (loaded.payload, n) not in seen.folds:
        seen.folds[loaded.payload, n] = resumes(run, loaded.payload, n)
    assert seen.folds[loaded.payload, n], where


def enumerate_and_check(commits: int, segment_bytes: int, byte_step: int) -> tuple[int, int]:
    """(operations recorded, distinct crash states checked)."""
    with tempfile.TemporaryDirectory(dir=SCRATCH) as tmp:
        run = record_run(Path(tmp) / "run", commits, segment_bytes)
        states = distinct_states(run, byte_step)
        kinds = {op.kind for op in run.rec.ops}
        assert {"create", "write", "sync", "rename", "dirsync", "unlink"} <= kinds, kinds
        seen = Outcomes()
        for state in states:
            check_state(run, state, Path(tmp) / "state", seen)
        return len(run.rec.ops), len(states)


def test_every_sampled_crash_state_of_a_short_run_recovers(capsys: pytest.CaptureFixture[str]) -> None:
    ops, states = enumerate_and_check(commits=9, segment_bytes=700, byte_step=23)
    with capsys.disabled():
        print(f"\ncrash states (quick): {ops} operations recorded, {states} distinct states recovered")
    assert states > 300


# Cutting at every byte takes several times longer, too long for every CI
# run: CI cuts at every third byte; EVENTSCHED_CRASH_EVERY_BYTE=1 cuts at all.
EVERY_BYTE = os.environ.get("EVENTSCHED_CRASH_EVERY_BYTE") == "1"


@pytest.mark.slow
def test_every_crash_state_of_a_longer_run_recovers_cut_at_every_byte(capsys: pytest.CaptureFixture[str]) -> None:
    step = 1 if EVERY_BYTE else 3
    ops, states = enumerate_and_check(commits=20, segment_bytes=1200, byte_step=step)
    with capsys.disabled():
        print(f"\ncrash states (cut every {step} byte(s)): {ops} operations recorded, {states} distinct states recovered")
    assert states > 5000


def crash_during_recovery(run: Run, state: CrashState, work: Path) -> int:
    """Recover ``state`` through a recorder, then check every state a power
    cut during that recovery can leave: recovering it again gives the same
    events, and bytes cut from a torn tail are kept aside whenever the cut is
    on disk. Returns the number of states checked (0: nothing was cut)."""
    shutil.rmtree(work, ignore_errors=True)
    (work / "log").mkdir(parents=True)
    (work / "snapshots").mkdir()
    materialize(state, work)
    rec = Recorder(work)
    w = L.LogWriter.open(work / "log", ops=rec)
    report = w.recovered
    w.close()
    if report is None:
        return 0
    want = list(L.read(work / "log"))
    cut_bytes = Path(report.kept_at).read_bytes()
    segment = os.path.relpath(report.segment, work)
    kept = os.path.relpath(report.kept_at, work)
    again = work.parent / (work.name + "-again")
    seen: set[Files] = set()
    for cut in range(len(rec.ops) + 1):
        for inner in crash_states(rec, cut, byte_step=3):
            if inner.key() in seen:
                continue
            seen.add(inner.key())
            where = f"crash after op {cut} ({inner.how}) of recovering {state.how} at op {state.cut}"
            if len(inner.files[segment]) <= report.offset:
                assert inner.files.get(kept) == cut_bytes, f"{where}: the torn tail was cut but not kept aside"
            _fresh(inner, again, "log")  # a recovery reads the log folder alone
            try:
                L.LogWriter.open(again / "log").close()
            except L.LogError as exc:
                raise AssertionError(f"{where}: refused: {exc}") from None
            assert list(L.read(again / "log")) == want, where
    return len(seen)


def _recoveries(byte_step: int, every: int) -> tuple[int, int]:
    """(torn states whose recovery was crashed, states of those recoveries checked)."""
    with tempfile.TemporaryDirectory(dir=SCRATCH) as tmp:  # tmpfs: thousands of fsyncs cost nothing
        run = record_run(Path(tmp) / "run", commits=9, segment_bytes=700)
        torn = [s for s in distinct_states(run, byte_step=byte_step) if "cut at byte" in s.how][::every]
        return len(torn), sum(crash_during_recovery(run, s, Path(tmp) / "st") for s in torn)


def test_a_power_cut_during_recovery_loses_nothing_and_keeps_the_torn_bytes() -> None:
    torn, checked = _recoveries(byte_step=29, every=60)
    assert torn >= 3 and checked > 20


@pytest.mark.slow
def test_a_power_cut_during_any_recovery_of_a_torn_tail(capsys: pytest.CaptureFixture[str]) -> None:
    torn, checked = _recoveries(byte_step=13, every=3)
    with capsys.disabled():
        print(f"\ncrash during recovery: {torn} torn states recovered through a recorder, {checked} states checked")
    assert checked > 1000


def test_damage_in_the_middle_of_the_log_is_refused_with_a_clear_message(tmp_path: Path) -> None:
    run = record_run(tmp_path / "run", commits=9, segment_bytes=700)
    seg = L.segments(tmp_path / "run" / "log")[0].path
    data = bytearray(Path(seg).read_bytes())
    data[L.SEGMENT_HEADER_SIZE + L.FRAME_HEADER_SIZE + 3] ^= 0x10  # a bit flip in the first frame's payload
    Path(seg).write_bytes(bytes(data))
    with pytest.raises(L.LogCorruptError) as info:
        L.LogWriter.open(tmp_path / "run" / "log")
    message = str(info.value)
    assert "damaged at byte 32" in message and "log repair" in message and "\n" not in message
    code, err = _verify(tmp_path / "run" / "log")
    assert code == 1 and "damaged" in err
    assert Path(seg).read_bytes() == bytes(data), "a refusal must change nothing"
    assert run.written  # the run wrote events; they are all still there to repair from


def test_the_plain_file_calls_are_the_default_and_record_nothing(tmp_path: Path) -> None:
    from eventsched.storage.fileops import PLAIN

    w = L.LogWriter.open(tmp_path / "log")
    try:
        assert w._ops is PLAIN and L.LogWriter._pwrite is os.pwrite and w._pwrite is os.pwrite
    finally:
        w.close()
