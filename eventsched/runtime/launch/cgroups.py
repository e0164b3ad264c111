"""Each job in its own cgroup v2, so nothing it starts escapes a cancel.

A job that calls ``setsid`` or ``setpgid`` leaves its process group; it
cannot leave its cgroup (only a writer of a common ancestor's ``cgroup.procs``
can move it). At start-up ``Cgroups.setup`` makes the parent
``<own cgroup>/eventsched-<hash of the state dir>`` (or a sibling, if a child
of ours cannot hold processes) and proves it can contain a throw-away process;
each attempt is then born in ``<parent>/job-<id>-<attempt>``. Where that does
not work, jobs are contained by their process group only and ``setup`` says
why in one line. Only the memory controller is ever enabled.

The I/O on one cgroup directory is ``cgroupfs.py``, which the supervisor shares.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from eventsched.runtime.launch.cgroupfs import kill_all, procs, remove, signal_all
from eventsched.runtime.launch.cgroupfs import read as _read
from eventsched.runtime.launch.cgroupfs import write as _write

__all__ = [
    "Cgroups", "cgroup2_mounts", "own_cgroup", "find_own_cgroup_dir", "procs", "signal_all", "kill_all", "remove",
    "HostMemory", "MEMORY_MODES", "v1_memory_dir", "enable_memory_v2",
]


def _unescape(field: str) -> str:
    """mountinfo escapes space, tab, newline and backslash as \\ooo."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), field)


def _mounts(mountinfo: str, wanted: Callable[[list[str]], bool]) -> list[tuple[str, str]]:
    """(root within the hierarchy, mount point) of every mount in a
    ``/proc/self/mountinfo`` text whose fields after `` - `` are ``wanted``, in order."""
    found = []
    for line in mountinfo.splitlines():
        left, sep, right = line.partition(" - ")
        fields = left.split()
        if sep and len(fields) >= 5 and wanted(right.split()):
            found.append((_unescape(fields[3]), _unescape(fields[4])))
    return found


def cgroup2_mounts(mountinfo: str) -> list[tuple[str, str]]:
    return _mounts(mountinfo, lambda fs: fs[:1] == ["cgroup2"])


def own_cgroup(proc_cgroup: str) -> str | None:
    """Our path in the cgroup2 hierarchy: the ``0::PATH`` line of ``/proc/self/cgroup``."""
    for line in proc_cgroup.splitlines():
        if line.startswith("0::"):
            return line[3:].removesuffix(" (deleted)") or "/"
    return None


def find_own_cgroup_dir(mountinfo: str, proc_cgroup: str, *, isdir: Callable[[str], bool] = os.path.isdir) -> str | None:
    """The directory of our own cgroup under a cgroup2 mount, or None."""
    return _mounted_dir(cgroup2_mounts(mountinfo), own_cgroup(proc_cgroup), isdir)


def _mounted_dir(mounts: list[tuple[str, str]], path: str | None, isdir: Callable[[str], bool]) -> str | None:
    """Where the cgroup ``path`` of a hierarchy is, under the first of its ``mounts`` that holds it."""
    if path is None:
        return None
    for root, mount in mounts:
        top = root.rstrip("/")  # "" for the whole hierarchy: every path is under it
        if path != root and not path.startswith(top + "/"):
            continue  # a mount of another part of the hierarchy
        candidate = os.path.normpath(mount + "/" + path[len(top) :].lstrip("/"))
        if isdir(candidate):
            return candidate
    return None


def _parent_name(state_dir: str | os.PathLike[str]) -> str:
    return "eventsched-" + hashlib.sha256(os.path.realpath(state_dir).encode()).hexdigest()[:12]


@contextlib.contextmanager
def _made(parent: str) -> Iterator[None]:
    """``parent`` for the block (OSError if it cannot be made), removed after
    if the block made it: a probe leaves no cgroup behind."""
    made = not os.path.isdir(parent)
    os.makedirs(parent, 0o755, exist_ok=True)
    try:
        yield
    finally:
        if made:
            remove(parent)


def _probe(parent: str, v1_limit: bool = False) -> str:
    """Prove a process can be moved into (and killed in) a child of ``parent``
    (``v1_limit``: a v1 memory cgroup, limited); "" if so, else what went wrong."""
    probe = os.path.join(parent, f"probe-{os.getpid()}")
    p: subprocess.Popen | None = None
    doing = f"cannot create {probe}"
    try:
        with contextlib.suppress(FileExistsError):
            os.mkdir(probe, 0o755)
        if v1_limit:
            _write(os.path.join(probe, "memory.limit_in_bytes"), str(1 << 30))
        doing = "cannot start a probe process"
        argv = ["sleep", "30"] if shutil.which("sleep") else [sys.executable, "-c", "import time; time.sleep(30)"]
        p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             start_new_session=True)
        doing = f"cannot move a process into {probe}"
        _write(os.path.join(probe, "cgroup.procs"), str(p.pid))
        return ""
    except OSError as e:
        return f"cgroup v1 memory not usable at {parent} ({e.strerror})" if v1_limit else f"{doing}: {e.strerror}"
    finally:
        kill_all(probe)
        if p is not None:
            p.kill()
            p.wait()
        remove(probe, timeout_s=2.0)


@dataclass(frozen=True)
class Cgroups:
    """The daemon's parent cgroup for its jobs' cgroups."""

    parent: str

    @classmethod
    def setup(cls, state_dir: str | os.PathLike[str]) -> tuple[Cgroups | None, str]:
        """(Cgroups, "") where the daemon can contain its jobs, else (None,
        one line saying what is missing). The parent is made again at the first launch."""
        mountinfo = _read("/proc/self/mountinfo")
        if not cgroup2_mounts(mountinfo):
            return None, "no cgroup v2 mount in /proc/self/mountinfo"
        own = find_own_cgroup_dir(mountinfo, _read("/proc/self/cgroup"))
        if own is None:
            return None, "cannot find this process's cgroup v2 directory"
        name = _parent_name(state_dir)
        candidates = [os.path.join(own, name)]
        if own not in {m for _, m in cgroup2_mounts(mountinfo)}:  # a sibling, if our own cgroup cannot hold children with processes
            candidates.append(os.path.join(os.path.dirname(own), name))
        why = ""
        for parent in candidates:
            try:
                with _made(parent):
                    problem = _probe(parent)
            except OSError as e:
                why = why or f"cgroup v2 not writable at {os.path.dirname(parent)} ({e.strerror})"
                continue
            if not problem:
                return cls(parent), ""
            why = why or f"cgroup v2 not writable at {parent} ({problem})"
        return None, why

    @property
    def containment(self) -> str:
        return f"cgroup2:{self.parent}"

    def create(self, job: int, attempt: int) -> str:
        """Make (or reuse) the cgroup of one job attempt; its path."""
        path = os.path.join(self.parent, f"job-{job}-{attempt}")
        for _ in range(3):  # the parent may be removed at the same moment
            try:
                os.mkdir(path, 0o755)
                return path
            except FileExistsError:
                return path
            except FileNotFoundError:  # made on first use, and again if removed meanwhile
                os.makedirs(self.parent, 0o755, exist_ok=True)
        raise FileNotFoundError(errno.ENOENT, "cgroup parent vanished", self.parent)

    def remove_parent(self) -> None:
        """At shutdown: gone if no job cgroup is left (EBUSY otherwise)."""
        with contextlib.suppress(OSError):
            os.rmdir(self.parent)


# Host memory limits, by the best means found at start-up: ``cgroup2``
# (memory.max on the job's own cgroup, where the memory controller can be
# enabled), ``cgroup1`` (a job cgroup in the v1 memory hierarchy of a hybrid
# host, joined before exec), else ``rlimit-as`` (RLIMIT_AS before exec: CUDA
# reserves much address space, so GPU jobs need a generous limit). The
# supervisor tells a kill for the limit by the cgroup's oom_kill count.

MEMORY_MODES = ("cgroup2", "cgroup1", "rlimit-as")
MIB = 1 << 20


def v1_memory_dir(mountinfo: str, proc_cgroup: str, *, isdir: Callable[[str], bool] = os.path.isdir) -> str | None:
    """The directory of our own cgroup in the v1 ``memory`` hierarchy, or None."""
    mounts = _mounts(mountinfo, lambda fs: len(fs) >= 3 and fs[0] == "cgroup" and "memory" in fs[2].split(","))
    own = None
    for line in proc_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3 and "memory" in parts[1].split(","):
            own = parts[2] or "/"
    return _mounted_dir(mounts, own, isdir)


def enable_memory_v2(parent: str) -> bool:
    """Make sure the cgroup v2 memory controller is on for the children of
    ``parent`` (enabling it one level up first if need be); True if it is."""
    if "memory" in _read(os.path.join(parent, "cgroup.subtree_control")).split():
        return True
    if "memory" not in _read(os.path.join(parent, "cgroup.controllers")).split():
        with contextlib.suppress(OSError):
            _write(os.path.join(os.path.dirname(parent), "cgroup.subtree_control"), "+memory")
    try:
        _write(os.path.join(parent, "cgroup.subtree_control"), "+memory")
    except OSError:
        return False
    return True


@dataclass(frozen=True)
class HostMemory:
    """How job memory limits are enforced here: ``mode`` is one of
    ``MEMORY_MODES``; ``parent`` the v1 parent cgroup (``cgroup1``) or the v2
    one (``cgroup2``)."""

    mode: str
    parent: str = ""

    @classmethod
    def setup(
        cls, state_dir: str | os.PathLike[str], cgroups: Cgroups | None, *, forced: str = ""
    ) -> tuple[HostMemory, str]:
        """The best mode available (or ``forced``, if available), and one
        line on what was chosen and why."""
        if forced and forced not in (*MEMORY_MODES, "auto"):
            return cls("rlimit-as"), f"unknown memory limit mode {forced!r}: using RLIMIT_AS"
        why: list[str] = []
        if forced in ("", "auto", "cgroup2"):
            if cgroups is None:
                why.append("no cgroup v2 of our own")
            elif _memory_v2_possible(cgroups.parent):
                return cls("cgroup2", cgroups.parent), f"memory.max on each job's cgroup under {cgroups.parent}"
            else:
                why.append(f"the cgroup v2 memory controller cannot be enabled under {cgroups.parent}")
        if forced in ("", "auto", "cgroup1"):
            own = v1_memory_dir(_read("/proc/self/mountinfo"), _read("/proc/self/cgroup"))
            if own is None:
                why.append("no cgroup v1 memory hierarchy")
            else:
                parent = os.path.join(own, _parent_name(state_dir))
                problem = _probe_v1(parent)
                if not problem:
                    return cls("cgroup1", parent), f"memory.limit_in_bytes on each job's cgroup v1 under {parent}"
                why.append(problem)
        return cls("rlimit-as"), "RLIMIT_AS set before exec (" + "; ".join(why or ["as configured"]) + ")"

    def create(self, job: int, attempt: int, v2_cgroup: str, limit_mib: int) -> str:
        """Put ``limit_mib`` on the job's memory. Returns the v1 cgroup the
        job must join (``cgroup1``), else ""; raises OSError if it cannot."""
        limit = str(limit_mib * MIB)
        if self.mode == "cgroup2":
            if not v2_cgroup:
                raise OSError(errno.ENOENT, "the job has no cgroup v2")
            enable_memory_v2(self.parent)
            _write(os.path.join(v2_cgroup, "memory.max"), limit)
            with contextlib.suppress(OSError):  # no swap accounting: nothing to turn off
                _write(os.path.join(v2_cgroup, "memory.swap.max"), "0")
            return ""
        if self.mode == "cgroup1":
            os.makedirs(self.parent, 0o755, exist_ok=True)
            path = os.path.join(self.parent, f"job-{job}-{attempt}")
            with contextlib.suppress(FileExistsError):
                os.mkdir(path, 0o755)
            try:
                _write(os.path.join(path, "memory.limit_in_bytes"), limit)
                with contextlib.suppress(OSError):  # swap accounting off: RAM alone is limited
                    _write(os.path.join(path, "memory.memsw.limit_in_bytes"), limit)
            except OSError:
                remove(path)
                raise
            return path
        return ""

    def remove_parent(self) -> None:
        if self.mode == "cgroup1":
            with contextlib.suppress(OSError):
                os.rmdir(self.parent)


def _memory_v2_possible(parent: str) -> bool:
    try:
        with _made(parent):
            return enable_memory_v2(parent)
    except OSError:
        return False


def _probe_v1(parent: str) -> str:
    try:
        with _made(parent):
            return _probe(parent, v1_limit=True)
    except OSError as e:
        return f"cgroup v1 memory not writable at {os.path.dirname(parent)} ({e.strerror})"
