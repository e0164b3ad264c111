"""The single-writer loop: the only place that appends to the log.

One task drains the inbox, runs each message through the sans-I/O core and
writes the batch as one frame (group commit); clients are answered and
effects performed only once an fdatasync made it durable, in order. The rest
(socket, exit watcher, GPU sampler, timer) only sends messages to the inbox.
The projection runs ahead of the disk: if a write fails (disk full) it is
rebuilt from the log and the clients of the batches not written are refused.
docs/launch-path.md says why the commit works as it does.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import anyio
import anyio.abc
import anyio.lowlevel

from eventsched import __version__, core
from eventsched.domain import events as ev
from eventsched.domain.messages import (
    Effect, GpuObserved, Launch, Message, Notify, ProcessExited, RefusalKind, Refused, SchedulerConfig, Signal,
    Started, Stopping, Tick, WakeAt,
)
from eventsched.domain.paths import log_dir, snapshot_dir
from eventsched.domain.states import JobState
from eventsched.domain.tenants import Tenant
from eventsched.projections import collector, snapshot
from eventsched.projections.cluster import ClusterState, apply
from eventsched.runtime import snapshot_child
from eventsched.runtime.gpus import GpuBackend, SampleFilter
from eventsched.runtime.launch.executor import AlreadyLaunched, LaunchError
from eventsched.runtime.ports import Clock, Executor, SteadyClock
from eventsched.storage import log as eventlog
from eventsched.storage import snapshots
from eventsched.storage.fileops import FileOps

logger = logging.getLogger("eventsched.engine")

INBOX_SIZE = 65_536
MAX_BATCH = 8_192
# a moving average of fdatasyncs above this sends them to the commit thread:
# a slow disk goes there, one slow fdatasync on a fast disk does not
SLOW_SYNC_S = 0.0005
SYNC_AVERAGE_WEIGHT = 0.2  # of the latest fdatasync in that average
GATHER_STEPS = 6  # more loop steps before a batch is taken (see _gather)
# a batch nobody waits on is made durable with the next one somebody does, or after this
# long (lost in a crash, a restart reads it again from the attempt records and the GPUs)
LAZY_COMMIT_S = 0.01
RETRY_AFTER_FULL_S = 1.0  # an observation refused by a full disk is handled again this much later


@dataclass
class Query:
    """A read of the projection, answered after the batch it arrived in commits."""

    read: Callable[[ClusterState], Any]


Answer = Callable[[ClusterState, list[ev.Event]], Any]
Reply = Callable[[Any, Refused | None], None]


class Pending:
    """One item of the inbox (a plain slotted class: one is made per request)."""

    __slots__ = ("item", "answer", "reply", "error", "produced", "result")

    def __init__(self, item: Message | Query, answer: Answer | None = None, reply: Reply | None = None) -> None:
        self.item = item
        self.answer = answer  # what the caller gets back, read from the projection after the commit
        self.reply = reply  # called once, inside the loop, after the commit: (result, error)
        self.error: Refused | None = None
        self.produced: list[ev.Event] = []
        self.result: Any = None  # read when its batch is decided, sent once the batch is durable


class Decided:
    """A batch run through the core, waiting for the log to be durable up to ``upto``."""

    __slots__ = ("upto", "batch", "effects", "payload")

    def __init__(self, upto: int, batch: list[Pending], effects: list[Effect]) -> None:
        self.upto, self.batch, self.effects = upto, batch, effects
        self.payload: bytes | None = None  # the frame's, on the last batch it holds


def prepare_state_dir(state_dir: Path) -> None:
    """Create the state dir, or tighten one that is ours: a root daemon's users
    may traverse it (to reach their output and the socket), nobody else may."""
    mode = 0o711 if os.geteuid() == 0 else 0o700
    state_dir.mkdir(parents=True, exist_ok=True, mode=mode)
    st = state_dir.stat()
    if st.st_uid == os.geteuid() and st.st_mode & 0o777 & ~mode:
        os.chmod(state_dir, mode)


class Engine:
    def __init__(
        self,
        state_dir: Path,
        config: SchedulerConfig,
        backend: GpuBackend,
        *,
        executor: Executor,
        sample_interval_s: float = 2.0,
        snapshot_every: int = 50_000,
        segment_bytes: int = 64 << 20,
        clock: Clock | None = None,  # default: a SteadyClock
        tenants: dict[str, Tenant] | None = None,
        log_ops: FileOps | None = None,  # the log's file calls (a test's slow or full disk)
    ) -> None:
        self.state_dir = state_dir
        self.config = config
        self.tenants = tenants  # the config file's [tenants] (None: keep the log's)
        self.backend = backend
        self.executor = executor
        self.sample_interval_s = sample_interval_s
        self.snapshot_every = snapshot_every
        self.segment_bytes = segment_bytes
        self.log_ops = log_ops
        self.clock: Clock = clock if clock is not None else SteadyClock()
        self._last_now = 0.0  # the latest time handed to the core: times in the log never go back
        self._last_requesters = 0  # requests the last batch answered: about how many will come back
        self.state: ClusterState | None = None
        self.log: eventlog.LogWriter | None = None
        # a deque and asyncio's event, not an anyio memory stream: an item
        # costs an append, not a checkpoint and a backend lookup
        self._inbox: collections.deque[Pending] = collections.deque()
        self._inbox_ready = asyncio.Event()
        self._inbox_room = asyncio.Event()  # set when a batch is taken: an exit waiting for room goes in
        self._committer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="eventsched-commit")
        self._sync_in_thread = False  # fdatasyncs have been slow (see _commit)
        self._sync_average_s = 0.0
        self._syncing = False  # an fdatasync runs in the commit thread
        self._sync_wanted = asyncio.Event()
        self._unwritten: list[ev.Event] = []  # decided while an fdatasync ran, or nobody waits on yet
        self._needed = 0  # the last seq a reply or an effect waits on: the log is made durable up to it
        self._lazy = asyncio.Event()  # set when events nobody waits on are left unwritten
        self._unreleased: collections.deque[Decided] = collections.deque()
        self._released = asyncio.Event()
        self._stale = False  # a full disk refused a write: the state is read again from the log
        self._subscribers: set[Callable[[bytes], bool]] = set()
        # called once a batch's replies are all given (the server writes them then)
        self.on_answered: Callable[[], None] | None = None
        self._wake_at = math.inf
        self._wake_changed = anyio.Event()
        self._last_snapshot_seq = 0
        self._snapshot_child: int | None = None  # the pid writing a snapshot
        self._stopping = False
        self._samples = SampleFilter()
        self.committed_seq = 0

    async def call(self, item: Message | Query, answer: Answer | None = None) -> Any:
        """Send a command or query and wait until its events are durable."""
        done = anyio.Event()
        outcome: list[Any] = []

        def reply(result: Any, error: Refused | None) -> None:
            outcome[:] = [result, error]
            done.set()

        self.submit_nowait(item, answer, reply)
        await done.wait()
        result, error = outcome
        if error is not None:
            raise error
        return result

    def submit_nowait(self, item: Message | Query, answer: Answer | None, reply: Reply) -> None:
        """``call`` for callers that cannot await: ``reply`` is called from the loop."""
        if self._stopping:
            reply(None, Refused(RefusalKind.UNAVAILABLE, "the daemon is shutting down"))
            return
        if len(self._inbox) >= INBOX_SIZE:
            reply(None, Refused(RefusalKind.UNAVAILABLE, "the daemon is overloaded; try again"))
            return
        self._enqueue(Pending(item, answer, reply))

    @property
    def backlog(self) -> int:  # messages waiting in the inbox
        return len(self._inbox)

    def _enqueue(self, pending: Pending) -> None:
        self._inbox.append(pending)
        self._inbox_ready.set()

    async def tell(self, item: Message) -> None:
        """Send an observation nobody waits for. When the inbox is full a GPU
        sample is dropped (the next says the same); an exit waits for room."""
        while len(self._inbox) >= INBOX_SIZE:
            if isinstance(item, GpuObserved):
                return
            self._inbox_room.clear()
            await self._inbox_room.wait()
        self._enqueue(Pending(item))
        await anyio.lowlevel.checkpoint()

    __call__ = tell  # the engine is the executor's outbox (``ports.Outbox``)

    def subscribe(self, deliver: Callable[[bytes], bool]) -> int:
        """Register for live batches (``deliver`` returns False to be dropped); the
        last committed seq, taken in the same step, so history up to it plus the
        stream lose nothing."""
        self._subscribers.add(deliver)
        return self.committed_seq

    def unsubscribe(self, deliver: Callable[[bytes], bool]) -> None:
        self._subscribers.discard(deliver)

    def _load_state(self) -> ClusterState:
        """Newest valid snapshot plus the log's tail (or the whole log)."""
        with collector.paused():
            state = snapshot.load_latest(snapshot_dir(self.state_dir)) or ClusterState()
            for batch in eventlog.read_batches(log_dir(self.state_dir), from_seq=state.last_seq + 1):
                for event in batch:
                    apply(state, event)
            # sorted here, not by the first listing on the loop, where it would stall every client
            state.queue.build_orders()
            if state.policy == "sjf-backfill":
                state.queue.build_groups()
            # else the collector's first pass walks the whole state (all of it in generation 0)
            collector.freeze_survivors()
        return state

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        prepare_state_dir(self.state_dir)
        self.log = eventlog.LogWriter.open(log_dir(self.state_dir), segment_bytes=self.segment_bytes, ops=self.log_ops)
        try:
            if self.log.recovered is not None:
                logger.warning("log recovery: %s", self.log.recovered)
            self.state = await anyio.to_thread.run_sync(self._load_state)
            self.committed_seq = self.log.next_seq - 1
            for last in eventlog.read(log_dir(self.state_dir), from_seq=max(1, self.committed_seq)):
                self._last_now = last.ts
            self.clock.not_before(self._last_now)
            self._last_snapshot_seq = self.state.last_seq
            gpus = self.backend.discover()
            started = Started(node=self.config.node, pid=os.getpid(), version=__version__, gpu_backend=self.backend.name,
                              gpus=gpus, config=self.config, tenants=self.tenants)
            running = {job.id: (job.pid or 0, job.start_time or 0)
                       for job in self.state.jobs.values() if job.state == JobState.RUNNING}
            attempts = {job: self.state.jobs[job].attempts for job in running}
            recovered = self.executor.recover(running, attempts)
            for message in [started, *recovered]:
                self._enqueue(Pending(message))
            # no full collection walks the state (projections/collector.py)
            with collector.freezing_after_full_collections(), collector.fewer_young_passes():
                await self._serve(task_status)
        finally:
            with anyio.CancelScope(shield=True):
                await self._shutdown()

    async def _serve(self, task_status: anyio.abc.TaskStatus[None]) -> None:
        async with anyio.create_task_group() as tg:
            self._tg = tg
            tg.start_soon(self._main_loop)
            tg.start_soon(self._syncer)
            tg.start_soon(self._flush_lazily)
            tg.start_soon(self.executor.run, self)
            tg.start_soon(self._timer)
            tg.start_soon(self._sampler)
            task_status.started()

    async def stop(self, reason: str = "signal") -> None:
        """Record the stop, then cancel every task. Jobs keep running."""
        if self._stopping:
            return
        if not hasattr(self, "_tg"):  # never ran: nothing to record or cancel
            self._stopping = True
            return
        try:
            await self.call(Stopping(node=self.config.node, reason=reason))
        except Refused:
            pass
        self._stopping = True
        self._tg.cancel_scope.cancel()

    async def _shutdown(self) -> None:
        self._subscribers.clear()
        self._committer.shutdown(wait=True)  # an append may still run there: the log is closed after it
        if self._snapshot_child is not None:  # let it finish before the last one is written
            snapshot_child.wait(self._snapshot_child)
            self._snapshot_child = None
        if self.log is not None:
            # what nobody waited on is kept all the same (in order: nothing before it was refused)
            if self._unwritten and not self._stale and self._unwritten[0].seq == self.log.next_seq:
                try:
                    self.log.sync()
                    self.log.write(self._unwritten)
                    self.log.sync()
                except eventlog.LogError as exc:
                    logger.warning("could not write the last events at shutdown: %s", exc)
                self._unwritten = []
            if self.state is not None and self.state.last_seq > self._last_snapshot_seq:
                try:
                    if self.log.sync() == self.state.last_seq:  # a snapshot is never ahead of the durable log
                        snapshot.save(snapshot_dir(self.state_dir), self.state)
                except (OSError, eventlog.LogError) as exc:
                    logger.warning("could not save a snapshot at shutdown: %s", exc)
            self.log.close()
            self.log = None

    async def _main_loop(self) -> None:
        assert self.state is not None and self.log is not None
        while True:
            while not self._inbox and not self._stale:
                await self._inbox_ready.wait()
                self._inbox_ready.clear()
            if self._stale:
                await self._reload()
                continue
            await self._gather()
            batch = [self._inbox.popleft() for _ in range(min(MAX_BATCH, len(self._inbox)))]
            self._inbox_room.set()
            # clamped: an injected clock (or anything else) that goes back
            # must not put a smaller time after a larger one in the log
            now = self._last_now = max(self.clock(), self._last_now)
            produced: list[ev.Event] = []
            effects: list[Effect] = []
            for pending in batch:
                if isinstance(pending.item, Query):
                    continue
                if isinstance(pending.item, GpuObserved) and not self._samples.keep(pending.item, now, self.state):
                    continue
                try:
                    events, item_effects = core.handle(self.state, pending.item, now)
                except Refused as refusal:
                    pending.error = refusal
                    continue
                pending.produced = events
                produced.extend(events)
                effects.extend(item_effects)
            self._unwritten.extend(produced)
            for pending in batch:
                if pending.reply is not None:
                    self._read_answer(pending)
            self._unreleased.append(Decided(self.state.last_seq, batch, effects))
            if effects or any(pending.reply is not None for pending in batch):
                self._needed = self.state.last_seq
            self._commit()
            # a snapshot is never ahead of the durable log
            if self.state.last_seq - self._last_snapshot_seq >= self.snapshot_every and await self._durable():
                await self._snapshot()

    async def _gather(self) -> None:
        """Let the loop run before the batch is taken, so that requests on other
        connections join its fdatasync: one step, more while fewer wait than the
        last batch answered (docs/launch-path.md)."""
        await asyncio.sleep(0)
        for _ in range(GATHER_STEPS):
            if len(self._inbox) >= self._last_requesters:
                return
            await asyncio.sleep(0)

    def _read_answer(self, pending: Pending) -> None:
        """The reply as of the state its batch left (later ones may be decided before it is sent)."""
        assert self.state is not None
        if pending.error is None:
            try:
                if isinstance(pending.item, Query):
                    pending.result = pending.item.read(self.state)
                elif pending.answer is not None:
                    pending.result = pending.answer(self.state, pending.produced)
                else:
                    pending.result = pending.produced
            except Refused as refusal:
                pending.error = refusal

    def _commit(self) -> None:
        """Write what was decided as one frame, make it durable and release its
        batches. A quick fdatasync runs on the loop (a hand-off costs more); slow
        ones run in the commit thread (``_syncer``), so a slow disk holds no socket."""
        assert self.log is not None
        if self._syncing:
            return
        self._write()
        if self._unwritten:
            self._lazy.set()
        if self.log.synced_seq < self.log.next_seq - 1:
            if self._sync_in_thread:
                self._syncing = True
                self._sync_wanted.set()
            else:
                self._note_sync(self._timed_sync())
        self._release()

    def _note_sync(self, took: float) -> None:
        self._sync_average_s += SYNC_AVERAGE_WEIGHT * (took - self._sync_average_s)
        self._sync_in_thread = self._sync_average_s > SLOW_SYNC_S

    def _timed_sync(self) -> float:
        assert self.log is not None
        started = time.monotonic()
        self.log.sync()
        return time.monotonic() - started

    async def _syncer(self) -> None:
        """The commit thread's side of ``_commit``: one fdatasync at a time."""
        assert self.log is not None
        loop = asyncio.get_running_loop()
        while True:
            await self._sync_wanted.wait()
            self._sync_wanted.clear()
            while self.log.synced_seq < self.log.next_seq - 1:
                took = await loop.run_in_executor(self._committer, self._timed_sync)
                self._note_sync(took)
                self._release()
                self._write()
            self._syncing = False
            if self._unwritten:
                self._lazy.set()

    async def _flush_lazily(self) -> None:
        """Make durable, ``LAZY_COMMIT_S`` after they were decided, events nobody waits on."""
        while True:
            await self._lazy.wait()
            self._lazy.clear()
            await asyncio.sleep(LAZY_COMMIT_S)
            if self._unwritten and not self._stale:
                self._needed = max(self._needed, self._unwritten[-1].seq)
                self._commit()

    def _write(self) -> None:
        """Every event decided since the last write as one frame (``LogWriter.write``
        allows one unsynced frame); nothing while none is waited on."""
        assert self.log is not None
        if not self._unwritten or self._needed < self._unwritten[0].seq:
            return
        events, self._unwritten = self._unwritten, []
        # the core stamped each event with the log's next seq: else a second writer or a bug
        if events[0].seq != self.log.next_seq:
            raise RuntimeError(f"core stamped seq {events[0].seq}, the log is at {self.log.next_seq}")
        try:
            _, self._unreleased[-1].payload = self.log.write(events)
        except eventlog.LogFullError as exc:  # nothing of these batches is written: refuse them all
            logger.error("append refused: %s", exc)
            again: list[Message] = []
            for decided in self._unreleased:
                if decided.upto < events[0].seq:
                    continue
                decided.effects = []
                for pending in decided.batch:
                    if pending.produced:
                        pending.error = Refused(RefusalKind.UNAVAILABLE, str(exc))
                        pending.produced = []
                    # an observation has no one to tell: handled again later, or lost
                    # for good (not a GPU sample: the next one says the same)
                    if pending.reply is None and not isinstance(pending.item, (GpuObserved, Query)):
                        again.append(pending.item)
            if again:
                self._tg.start_soon(self._retry_after_full, again)
            self._stale = True  # the main loop reads the state again before it decides more
            self._inbox_ready.set()
            self._released.set()

    async def _reload(self) -> None:
        """After a full disk refused a write: the state and the refused replies read again from the log."""
        assert self.log is not None
        self.state = await anyio.to_thread.run_sync(self._load_state)
        self._stale = False
        written = self.log.next_seq - 1
        for decided in self._unreleased:
            if decided.upto > written:
                decided.upto = written
                for pending in decided.batch:
                    if pending.reply is not None:
                        self._read_answer(pending)
        self._release()

    def _release(self) -> None:
        """Broadcast, acknowledge and perform every batch now durable, in order."""
        assert self.log is not None
        durable = self.log.synced_seq
        released: list[Decided] = []
        while self._unreleased and self._unreleased[0].upto <= durable:
            released.append(self._unreleased.popleft())
        if not released:
            return
        self.committed_seq = durable
        for decided in released:
            if decided.payload is not None and self._subscribers:
                self._broadcast(decided.payload)  # the bytes logged: the same events, encoded once
        requesters = 0
        for decided in released:
            for pending in decided.batch:
                if pending.reply is not None:
                    requesters += 1
                    pending.reply(pending.result, pending.error)
        if requesters:  # batches of observations alone (an exit, a sample) say nothing of them
            self._last_requesters = requesters
        if self.on_answered is not None:
            self.on_answered()
        for decided in released:
            for effect in decided.effects:
                self._perform(effect)
        self._released.set()

    async def _durable(self) -> bool:
        """Wait until every batch decided is released; False if a full disk refused some."""
        assert self.state is not None
        self._needed = self.state.last_seq
        self._commit()
        while self._unreleased and not self._stale:
            self._released.clear()
            await self._released.wait()
        return not self._stale

    async def _retry_after_full(self, items: list[Message]) -> None:
        await self.clock.sleep(RETRY_AFTER_FULL_S)
        for item in items:
            self._enqueue(Pending(item))

    def _broadcast(self, payload: bytes) -> None:
        for deliver in list(self._subscribers):
            if not deliver(payload):  # cannot keep up: it resubscribes from the last seq it saw
                self._subscribers.discard(deliver)

    async def _snapshot(self) -> None:
        assert self.state is not None
        if self._snapshot_child is not None:
            return  # the last one is still being written: the next batch tries again
        self._last_snapshot_seq = self.state.last_seq
        if self.executor.fork_safe:
            try:
                pid = snapshot_child.fork_and_save(snapshot_dir(self.state_dir), self.state)
            except OSError as exc:  # no memory or processes left for a fork: on the loop, as before
                logger.warning("cannot fork a snapshot writer (%s): writing it here", exc)
            else:
                self._snapshot_child = pid
                self._tg.start_soon(self._reap_snapshot, pid)
                return
        data = snapshot.snapshot_bytes(self.state)
        try:
            await anyio.to_thread.run_sync(snapshots.save_bytes, snapshot_dir(self.state_dir), self.state.last_seq, data)
        except OSError as exc:  # a snapshot is an optimisation: out of fds or space costs only the next start-up
            logger.warning("could not save a snapshot: %s", exc)

    async def _reap_snapshot(self, pid: int) -> None:
        # cancelled: the child stays recorded, and _shutdown waits for it
        code = await snapshot_child.reaped(pid)
        self._snapshot_child = None
        if code != 0:  # an optimisation lost: the next start-up reads more log
            logger.warning("could not save a snapshot: its writer (pid %d) exited with %d", pid, code)

    def _perform(self, effect: Effect) -> None:
        match effect:
            case Launch():
                self._tg.start_soon(self._launch, effect)
            case Signal():
                self._tg.start_soon(self.executor.signal, effect.job, effect.grace_s, effect.signum)
            case WakeAt():
                if effect.at < self._wake_at:
                    self._wake_at = effect.at
                    self._wake_changed.set()
            case Notify():  # once the fact behind it is durable
                logger.warning("%s", effect.text)

    def _show_load_to_gpus(self) -> None:
        """Fake GPUs report what the scheduler placed on them, as real ones would."""
        if self.state is not None:
            for gpu in self.state.all_gpus():
                if gpu.node == self.config.node and not gpu.lost:
                    self.backend.set_load(gpu.id, gpu.used_milli / 1000, gpu.reserved_mib)

    async def _launch(self, effect: Launch) -> None:
        try:
            started = await self.executor.launch(effect.job, effect.spec, effect.gpu_ids,
                                                 attempt=effect.attempt, node=effect.node)
        except AlreadyLaunched:
            return  # its supervisor reports how it goes
        except (LaunchError, OSError) as exc:  # OSError: e.g. out of file descriptors (EMFILE)
            await self.tell(ProcessExited(job=effect.job, exit_code=None, reason=f"launch-failed: {exc}"))
            return
        self._enqueue(Pending(started))  # no await since launch(): a short job's exit cannot overtake it

    async def _timer(self) -> None:
        """Send a Tick when the earliest deadline the core asked for comes."""
        while True:
            self._wake_changed = anyio.Event()
            delay = self._wake_at - self.clock()
            if delay <= 0:
                self._wake_at = math.inf
                await self.tell(Tick())
                continue
            async with anyio.create_task_group() as tg:  # whichever comes first: the time, or an earlier deadline
                tg.start_soon(self._until_changed, tg.cancel_scope)
                await self.clock.sleep(min(delay, 3600.0))
                tg.cancel_scope.cancel()

    async def _until_changed(self, scope: anyio.CancelScope) -> None:
        await self._wake_changed.wait()
        scope.cancel()

    async def _sampler(self) -> None:
        failures = 0
        while True:
            assert self.state is not None
            try:
                self._show_load_to_gpus()
                pids = self.executor.job_processes()  # {pid: job}: GPU memory per job
                samples = await anyio.to_thread.run_sync(self.backend.sample, pids)
            except Exception as exc:  # EMFILE on /proc, a backend bug: skip this sample, never die
                failures += 1
                if failures == 1 or failures % 100 == 0:
                    logger.warning("GPU sample skipped (%d so far): %s", failures, exc)
                samples = []
            for sample in samples:
                await self.tell(sample)
            await self.clock.sleep(self.sample_interval_s)
