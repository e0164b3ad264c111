"""The daemon follows a jobs file itself (config ``jobs_file = "PATH"``).

Every second it stats the file; when it changed it submits the lines not seen
yet, through the socket's admission, as the file's owner, in its folder. A
line is known by its ``PATH:LINE:SHA`` source, kept in the replayed state, so
no line is submitted twice. Who may write the file may run code as its owner,
so nothing is read while the file, a folder on its path or a symlink could be
changed by anyone but root, the owner or the daemon's user (``open_checked``).
``llm_config.json`` next to the file (else in the state dir) sizes ``--llm`` lines.
"""

from __future__ import annotations

import functools
import logging
import os
import pwd
import stat
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

import anyio
import anyio.abc
import anyio.to_thread

from eventsched.domain import messages as msg
from eventsched.domain.events import Event, JobSpec
from eventsched.domain.jobsfile import line_source, line_spec, parse_jobs_text, unreported
from eventsched.domain.llm import DEFAULT_LLM_CONFIG, LLM_CONFIG_NAME, LlmConfig, LlmConfigError, parse_llm_config
from eventsched.domain.paths import DEFAULT_PATH
from eventsched.projections.cluster import ClusterState
from eventsched.runtime.api.connection import Peer
from eventsched.runtime.api.server import Server

__all__ = ["follow_jobs_file", "JobsFileFollower", "Unsafe", "Owner", "open_checked", "INTERVAL_S", "MAX_FILE_BYTES"]

logger = logging.getLogger("eventsched.jobs_file")

INTERVAL_S = 1.0
MAX_FILE_BYTES = 16 << 20
SUBMIT_WINDOW = 512  # submissions in the engine's inbox at once
_CONDA_DIRS = ("miniconda3/bin", "anaconda3/bin", "miniforge3/bin", "mambaforge/bin")


class Unsafe(Exception):
    """The file may not be followed; ``str()`` says why, in one line."""


class Missing(Exception):
    """The file does not exist (yet)."""


class Changed(Exception):
    """The file changed while it was being checked: look again later."""


@dataclass(frozen=True)
class Owner:
    uid: int
    gid: int
    groups: list[int]
    user: str
    home: str


def run_as(file_uid: int, daemon_uid: int) -> Owner:
    if daemon_uid == 0:
        uid = file_uid
    elif file_uid in (0, daemon_uid):
        uid = daemon_uid  # a user's daemon runs every job as itself
    else:
        raise Unsafe(f"it belongs to uid {file_uid}, and this daemon (uid {daemon_uid}) runs jobs only as itself; "
                     "only root's or the daemon user's jobs file is followed")
    try:
        entry = pwd.getpwuid(uid)
    except KeyError:
        raise Unsafe(f"its owner, uid {uid}, has no account (no user name, groups or home to run the lines with)") from None
    return Owner(uid=uid, gid=entry.pw_gid, groups=os.getgrouplist(entry.pw_name, entry.pw_gid),
                 user=entry.pw_name, home=entry.pw_dir)


def _check_path(path: str, trusted: set[int]) -> None:
    """Every folder and symlink on ``path`` (absolute) belongs to a trusted
    uid, and no folder lets others replace what is in it."""
    folders = [str(folder) for folder in reversed(PurePosixPath(path).parents)]  # "/", "/a", "/a/b"
    for component in folders + ([path] if os.path.islink(path) else []):
        try:
            st = os.lstat(component)
        except FileNotFoundError:
            raise Missing(component) from None
        if st.st_uid not in trusted:
            raise Unsafe(f"{component} belongs to uid {st.st_uid}, who could replace the file")
        if stat.S_ISDIR(st.st_mode) and st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
            raise Unsafe(f"the folder {component} is writable by others (mode {stat.S_IMODE(st.st_mode):o}), "
                         "who could replace the file")


def open_checked(path: str, daemon_uid: int, owners: set[int] | None = None) -> tuple[int, os.stat_result]:
    """(fd, stat) of ``path`` once it passes every check; ``owners``: the uids
    it may belong to (None: any). Raises Unsafe, Missing or Changed."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOCTTY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise Missing(path) from None
    except OSError as exc:
        raise Unsafe(f"cannot open it: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise Unsafe("it is not a regular file")
        if st.st_mode & 0o022:
            raise Unsafe(f"it is group- or world-writable (mode {stat.S_IMODE(st.st_mode):o}): anyone who may "
                         f"write it could run code as its owner; `chmod go-w {path}` to follow it")
        if owners is not None and st.st_uid not in owners:
            raise Unsafe(f"it belongs to uid {st.st_uid}, not to uid {' or '.join(map(str, sorted(owners)))}")
        trusted = {0, daemon_uid, st.st_uid}
        _check_path(os.path.abspath(path), trusted)
        _check_path(os.path.realpath(path), trusted)
        try:
            now = os.stat(path)
        except FileNotFoundError:
            raise Missing(path) from None
        if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
            raise Changed(path)
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def _read(fd: int) -> bytes:
    try:
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise Unsafe(f"cannot read it: {exc.strerror}") from None
    if len(data) > MAX_FILE_BYTES:
        raise Unsafe(f"it is larger than {MAX_FILE_BYTES >> 20} MiB")
    return data


def _fingerprint(st: os.stat_result) -> tuple[int, ...]:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_uid, st.st_mode)


@dataclass
class Look:
    """What one look at the files found (in a worker thread)."""

    problem: str = ""  # why nothing is followed now ("" = fine)
    waiting: bool = False  # missing or changing: not an error, look again
    owner: Owner | None = None
    text: str | None = None  # None: unchanged since the last look
    fingerprint: tuple[int, ...] | None = None
    llm: LlmConfig | None = None  # None: unchanged
    llm_fingerprint: tuple[int, ...] | None = None


@dataclass
class JobsFileFollower:
    server: Server  # its engine takes the jobs; its checks admit them
    path: str  # absolute
    interval_s: float = INTERVAL_S
    daemon_uid: int = field(default_factory=os.geteuid)
    known: set[str] = field(default_factory=set)  # sources sent (submitted, skipped or refused)
    reported: set[tuple[int, str]] = field(default_factory=set)  # bad lines logged: (line, text)
    _fingerprint: tuple[int, ...] | None = None
    _llm_fingerprint: tuple[int, ...] | None = None
    _llm: LlmConfig = DEFAULT_LLM_CONFIG
    _held: bool = False
    _said: str = ""  # the last problem logged (each is logged once)

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        logger.info("following the jobs file %s", self.path)
        task_status.started()
        while True:
            try:
                await self.step()
            except Exception:  # a bug must cost one look, not the daemon
                logger.exception("jobs file %s: unexpected error; looking again later", self.path)
            await anyio.sleep(self.interval_s)

    def _say(self, level: int, text: str) -> None:
        if text != self._said:
            logger.log(level, "%s", text)
            self._said = text

    def look(self) -> Look:
        """In a worker thread: a slow file system must not stall the loop."""
        try:
            fd, st = open_checked(self.path, self.daemon_uid)
        except Missing:
            return Look(problem=f"jobs file {self.path} does not exist yet; waiting for it", waiting=True)
        except Changed:
            return Look(waiting=True)
        except Unsafe as exc:
            return Look(problem=f"jobs file {self.path} is not followed: {exc}")
        found = Look()
        try:
            found.owner = run_as(st.st_uid, self.daemon_uid)
            found.fingerprint = _fingerprint(st)
            if found.fingerprint != self._fingerprint or self._held:
                found.text = _read(fd).decode("utf-8", "surrogateescape")
            self._look_llm(found, st.st_uid)
        except Unsafe as exc:
            found.problem = f"jobs file {self.path} is not followed: {exc}"
        finally:
            os.close(fd)
        return found

    def _look_llm(self, found: Look, file_uid: int) -> None:
        beside = os.path.join(os.path.dirname(self.path), LLM_CONFIG_NAME)
        fallback = str(Path(self.server.engine.state_dir) / LLM_CONFIG_NAME)
        for candidate in (beside, fallback):
            try:
                fd, st = open_checked(candidate, self.daemon_uid, {0, self.daemon_uid, file_uid})
            except Missing:
                continue
            except Changed:
                found.waiting = True
                return
            except Unsafe as exc:
                raise Unsafe(f"its LLM config {candidate}: {exc}") from None
            fingerprint = (hash(candidate), *_fingerprint(st))
            try:
                if fingerprint != self._llm_fingerprint:
                    found.llm = parse_llm_config(_read(fd), candidate)
                    found.llm_fingerprint = fingerprint
            except LlmConfigError as exc:
                raise Unsafe(str(exc)) from None
            finally:
                os.close(fd)
            return
        if self._llm_fingerprint is not None:  # it was removed
            found.llm, found.llm_fingerprint = DEFAULT_LLM_CONFIG, None

    async def step(self) -> None:
        found = await anyio.to_thread.run_sync(self.look)
        if found.problem:
            self._say(logging.WARNING if found.waiting else logging.ERROR, found.problem)
            self._fingerprint = None  # read it again once it is fine
            return
        if found.waiting:
            return
        if self._said:
            self._say(logging.INFO, f"following the jobs file {self.path}")
            self._said = ""
        if found.llm is not None:  # llm_config.json is new, changed or gone
            self._llm, self._llm_fingerprint = found.llm, found.llm_fingerprint
            # lines refused with the old sizes are sent again (the core dedupes the others)
            self.known.clear()
            if found.text is None:
                self._fingerprint = None  # read the jobs file at the next look
        if found.text is None:
            return
        assert found.owner is not None and found.fingerprint is not None
        complete = found.fingerprint == self._fingerprint  # stood still since the last look
        self._fingerprint = found.fingerprint
        text = found.text
        # a last line without its newline may be half written: it waits for one more look
        self._held = not complete and bool(text) and not text.endswith("\n")
        if self._held:
            text = text[: text.rfind("\n") + 1]
        await self.submit(text, found.owner)

    def base_spec(self, owner: Owner) -> JobSpec:
        path = os.environ.get("PATH") or DEFAULT_PATH  # the daemon's: its operator's choice
        conda = [d for d in (os.path.join(owner.home, c) for c in _CONDA_DIRS) if os.path.isdir(d)]
        conda += ["/opt/conda/bin"] if os.path.isdir("/opt/conda/bin") else []
        env = {"PATH": ":".join([path, *conda]), "HOME": owner.home, "USER": owner.user, "LOGNAME": owner.user,
               "LANG": os.environ.get("LANG", "C.UTF-8")}
        return JobSpec(command=["python"], user=owner.user, uid=owner.uid, gid=owner.gid, groups=list(owner.groups),
                       home=owner.home, cwd=os.path.dirname(self.path), env=env)

    async def submit(self, text: str, owner: Owner) -> None:
        jobs, bad = parse_jobs_text(text)
        for problem in unreported(text, bad, self.reported):
            logger.error("%s:%d: %s", self.path, problem.line, problem.reason)
        base = self.base_spec(owner)
        peer = Peer(pid=0, uid=owner.uid, gid=owner.gid, groups=tuple(owner.groups))
        todo: list[tuple[int, JobSpec]] = []  # (line, spec)
        for job in jobs:
            source = line_source(self.path, job)
            if source in self.known:
                continue
            self.known.add(source)
            spec = line_spec(job, resolved_path=self.path, llm=self._llm, base=base)
            try:
                # the socket's own admission, as if the owner had submitted it
                spec = self.server.admission.as_peer(spec, peer)
            except msg.Refused as refusal:
                logger.error("%s:%d: %s", self.path, job.line, refusal.reason)
                continue
            todo.append((job.line, spec))
        for start in range(0, len(todo), SUBMIT_WINDOW):
            await self._submit_window(todo[start : start + SUBMIT_WINDOW], owner)

    async def _submit_window(self, window: list[tuple[int, JobSpec]], owner: Owner) -> None:
        """Hand a window of lines to the engine at once (one group commit), then wait for every answer."""
        results: list[tuple[int, Any, msg.Refused | None]] = []
        done = anyio.Event()

        def answer(_state: ClusterState, events: list[Event]) -> int:
            return int(events[0].job)  # type: ignore[attr-defined]

        def reply(line: int, result: Any, error: msg.Refused | None) -> None:
            results.append((line, result, error))
            if len(results) == len(window):
                done.set()

        for line, spec in window:
            self.server.engine.submit_nowait(msg.Submit(spec=spec, by=f"uid:{owner.uid}"), answer, functools.partial(reply, line))
        await done.wait()
        skipped = 0
        for line, result, error in sorted(results, key=lambda r: r[0]):
            if error is None:
                logger.info("%s:%d: submitted as job %d (user %s)", self.path, line, result, owner.user)
            elif error.kind == msg.RefusalKind.CONFLICT and error.existing is not None:
                skipped += 1  # submitted before (the core knows each line's source)
            elif error.kind == msg.RefusalKind.UNAVAILABLE:
                # not the line's fault (overloaded, stopping): send it again at the next look
                self.known.discard(next(s.source for n, s in window if n == line))
                self._fingerprint = None
            else:
                logger.error("%s:%d: %s", self.path, line, error.reason)
        if skipped:
            logger.debug("%s: %d lines already submitted", self.path, skipped)


async def follow_jobs_file(server: Server, path: str, *, interval_s: float = INTERVAL_S,
                           task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
    await JobsFileFollower(server, os.path.abspath(path), interval_s).run(task_status=task_status)
