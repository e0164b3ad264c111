"""A submitted spec made its submitter's own, or refused: the socket, the HTTP
API and the jobs-file follower all admit through here. Who runs a job comes
from the peer or the daemon's records, never from the spec.
"""

from __future__ import annotations

import functools
import os
import pwd
import shutil

import msgspec

from eventsched.core.admission import check_submission
from eventsched.core.limits import SubmitLimits
from eventsched.domain.events import JobSpec
from eventsched.domain.messages import RefusalKind, Refused
from eventsched.runtime.api import script_paths
from eventsched.runtime.api.connection import Peer
from eventsched.runtime.config import JobLimits

SESSION_PROGRAMS = ("tmux", "screen")


@functools.lru_cache(maxsize=1024)
def account(uid: int) -> tuple[str, str]:
    """User name and home of ``uid`` (cached: NSS lookups are slow)."""
    try:
        entry = pwd.getpwuid(uid)
    except KeyError:
        return str(uid), "/"
    return entry.pw_name, entry.pw_dir


class Admission:
    def __init__(self, limits: SubmitLimits, job_limits: JobLimits, daemon_uid: int) -> None:
        self.limits = limits
        self.job_limits = job_limits
        self.daemon_uid = daemon_uid

    def operator(self, uid: int) -> bool:
        """Root and the daemon's user: any priority, any program, any tenant change."""
        return uid in (0, self.daemon_uid)

    def as_peer(self, spec: JobSpec, peer: Peer) -> JobSpec:
        if self.daemon_uid != 0 and not self.operator(peer.uid):
            raise Refused(
                RefusalKind.FORBIDDEN,
                f"this daemon runs as uid {self.daemon_uid} and cannot run jobs as uid {peer.uid}; "
                "ask its owner, or run the daemon as root to serve several users",
            )
        check_submission(spec, self.limits, operator=self.operator(peer.uid))
        self._check_host(spec, peer)
        user, home = account(peer.uid)
        return msgspec.structs.replace(spec, user=user, uid=peer.uid, gid=peer.gid, groups=list(peer.groups), home=home)

    def _check_host(self, spec: JobSpec, peer: Peer) -> None:
        """--session needs its program, --host-mem its ceiling, the program its place."""
        if spec.session and spec.session not in SESSION_PROGRAMS:
            raise Refused(RefusalKind.INVALID, f"--session must be tmux or screen, not {spec.session!r}")
        if spec.session and shutil.which(spec.session, path=spec.env.get("PATH") or os.defpath) is None:
            raise Refused(
                RefusalKind.UNAVAILABLE, f"{spec.session} is not installed on this machine; apt-get install {spec.session}"
            )
        top = self.job_limits.max_host_mem_mib
        if spec.host_mem_mib < 0:
            raise Refused(RefusalKind.INVALID, f"--host-mem must be a positive number of MiB, not {spec.host_mem_mib}")
        if top > 0 and spec.host_mem_mib > top:
            raise Refused(
                RefusalKind.OVER_LIMIT, f"--host-mem {spec.host_mem_mib} MiB is above this machine's limit of {top} MiB per job"
            )
        refusal = script_paths.check(spec, self.job_limits.allowed_script_paths, operator=self.operator(peer.uid))
        if refusal is not None:
            raise Refused(RefusalKind.FORBIDDEN, refusal)
