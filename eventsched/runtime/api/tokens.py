"""API tokens for ``serve --http``: who a bearer token speaks for.

A token is made over the socket (so the daemon knows who asks) and shown once;
the daemon keeps only its SHA-256 (256 random bits need no password stretching)
in a 0600 file of the state directory. Not in the event log: others read the
log, and an append-only log can never forget a revoked credential.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import secrets
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from eventsched.domain.messages import RefusalKind, Refused
from eventsched.domain.text import printable
from eventsched.storage.fileops import fsync_dir

logger = logging.getLogger("eventsched.tokens")

TOKEN_FILE = "api-tokens.json"
PREFIX = "est_"  # recognisable in a leaked config file or a secret scanner
MAX_TOKENS_PER_USER = 64
MAX_NAME = 64


def digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


@dataclass(frozen=True)
class TokenRecord:
    id: str
    name: str
    uid: int
    created: float
    sha256: str

    def public(self, user: str) -> dict[str, object]:
        """What ``token list`` shows (never the hash)."""
        return {"id": self.id, "name": self.name, "uid": self.uid, "user": user, "created": self.created}


class TokenStore:
    """The tokens of one state directory; every change is saved before it is answered."""

    def __init__(self, state_dir: Path) -> None:
        self.path = state_dir / TOKEN_FILE
        self._lock = threading.Lock()  # changes are saved from worker threads
        self._by_hash: dict[str, TokenRecord] = {}
        self._load()

    def _load(self) -> None:
        try:
            info = self.path.stat()
        except FileNotFoundError:
            return
        if info.st_mode & 0o077:  # someone loosened it: close it again before reading
            logger.warning("%s was readable by others (mode %o); made it 0600", self.path, info.st_mode & 0o777)
            os.chmod(self.path, 0o600)
        try:
            records = [TokenRecord(**entry) for entry in json.loads(self.path.read_text()).get("tokens", [])]
        except (OSError, ValueError, TypeError, AttributeError) as exc:  # unreadable, not JSON, not our layout
            # no store: every token is refused until the file is fixed, and none is written over it
            raise Refused(RefusalKind.UNAVAILABLE, f"the token file {self.path} cannot be read "
                          f"({printable(str(exc))[:120]}); fix it, or move it aside to start with no tokens") from None
        self._by_hash = {record.sha256: record for record in records}

    def _save(self, by_hash: dict[str, TokenRecord]) -> None:
        """Write ``by_hash``, then make it the store's: a failed write changes nothing."""
        records = sorted(by_hash.values(), key=lambda r: r.created)
        text = json.dumps({"version": 1, "tokens": [asdict(r) for r in records]}, indent=1)
        tmp = self.path.with_name(f".{TOKEN_FILE}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        try:
            os.fchmod(fd, 0o600)  # whatever the umask
            os.write(fd, text.encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, self.path)
        fsync_dir(self.path.parent)
        self._by_hash = by_hash

    def create(self, uid: int, name: str) -> tuple[TokenRecord, str]:
        """A new token of ``uid``: (its record, the secret, shown once)."""
        name = name.strip()
        if len(name) > MAX_NAME or any(not (c.isalnum() or c in "-_.@") for c in name):
            raise Refused(RefusalKind.INVALID, f"a token's name is up to {MAX_NAME} letters, digits and - _ . @, not {name[:80]!r}")
        with self._lock:
            mine = [r for r in self._by_hash.values() if r.uid == uid]
            if len(mine) >= MAX_TOKENS_PER_USER:
                raise Refused(RefusalKind.OVER_LIMIT, f"uid {uid} already has {len(mine)} tokens (limit {MAX_TOKENS_PER_USER}); revoke some first")
            token_id = secrets.token_hex(4)
            name = name or f"token-{token_id}"
            if any(r.name == name for r in mine):
                raise Refused(RefusalKind.CONFLICT, f"you already have a token named {name!r}; revoke it or choose another name")
            secret = PREFIX + secrets.token_urlsafe(32)
            record = TokenRecord(id=token_id, name=name, uid=uid, created=round(time.time(), 3), sha256=digest(secret))
            self._save({**self._by_hash, record.sha256: record})
        logger.info("token %s (%s) created for uid %d", record.id, record.name, uid)
        return record, secret

    def visible(self, viewer: int, operator: bool) -> list[TokenRecord]:
        """The viewer's tokens (an operator's: everyone's), oldest first."""
        with self._lock:
            records = [r for r in self._by_hash.values() if operator or r.uid == viewer]
        return sorted(records, key=lambda r: r.created)

    def revoke(self, key: str, viewer: int, operator: bool) -> TokenRecord:
        """Forget the token whose id or name is ``key``, if the viewer may."""
        with self._lock:
            candidates = [r for r in self._by_hash.values() if (operator or r.uid == viewer) and key in (r.id, r.name)]
            own = [r for r in candidates if r.uid == viewer]
            if len(candidates) > 1 and len(own) == 1:
                candidates = own  # an operator's own token of that name comes first
            if not candidates:
                raise Refused(RefusalKind.NOT_FOUND, f"no token {key!r} of yours (see `eventsched token list`)")
            if len(candidates) > 1:
                raise Refused(RefusalKind.INVALID, f"several tokens are named {key!r}; revoke one by its id (`eventsched token list`)")
            record = candidates[0]
            before, self._by_hash = self._by_hash, {h: r for h, r in self._by_hash.items() if r is not record}
            try:  # revoked at once, not only once the file is written; back if it cannot be
                self._save(self._by_hash)
            except BaseException:
                self._by_hash = before
                raise
        logger.info("token %s (%s) of uid %d revoked by uid %d", record.id, record.name, record.uid, viewer)
        return record

    def lookup(self, secret: str) -> TokenRecord | None:
        if not secret.startswith(PREFIX) or len(secret) > 200:
            return None
        return self._by_hash.get(digest(secret))
