"""Who sees what: the one policy for job specs that cross to another user.

Everyone sees every job's metadata; only the owner, root and the daemon's
own user see its ``env`` and ``env_setup``, which hold tokens and keys. Every
``JobSubmitted`` or ``JobSpec`` handed to a client goes through here.
"""

from __future__ import annotations

from collections.abc import Collection

import msgspec

from eventsched.domain.events import Event, JobSpec, JobSubmitted, decode_many, encode_many

__all__ = ["redact_spec", "redact_events", "BatchView"]

# the tag of the one event that carries a spec, as msgpack writes it: a batch
# without these bytes has nothing to redact and goes out as it is
_SPEC_TAG = b"JobSubmitted"


def _has_secrets(spec: JobSpec) -> bool:
    return bool(spec.env or spec.env_setup)


def redact_spec(spec: JobSpec, viewer_uid: int, operators: Collection[int]) -> JobSpec:
    """``spec`` as ``viewer_uid`` may see it (the same object when nothing is hidden)."""
    if not _has_secrets(spec) or viewer_uid == spec.uid or viewer_uid in operators:
        return spec
    return msgspec.structs.replace(spec, env={}, env_setup="")


def redact_events(events: list[Event], viewer_uid: int, operators: Collection[int]) -> list[Event]:
    """``events`` as ``viewer_uid`` may see them (the same list when nothing is hidden)."""
    out: list[Event] | None = None
    for i, event in enumerate(events):
        if isinstance(event, JobSubmitted):
            spec = redact_spec(event.spec, viewer_uid, operators)
            if spec is not event.spec:
                out = out or list(events)
                out[i] = msgspec.structs.replace(event, spec=spec)
    return events if out is None else out


class BatchView:
    """One committed batch as each viewer may see it: most hold no submission and
    go out unchanged; else the redacted payload is encoded once for all, and each
    owner of a submission in it gets a variant with their own secrets left in."""

    __slots__ = ("payload", "operators", "_plain", "_events", "_owners", "_public", "_variants")

    def __init__(self, payload: bytes, operators: Collection[int]) -> None:
        self.payload = payload
        self.operators = operators
        self._events: list[Event] | None = None
        self._owners: frozenset[int] = frozenset()
        self._plain = _SPEC_TAG not in payload
        self._public: bytes | None = None
        self._variants: dict[int, bytes] = {}

    def for_viewer(self, uid: int) -> bytes:
        if self._plain or uid in self.operators:
            return self.payload
        if self._events is None:
            self._events = decode_many(self.payload)
            self._owners = frozenset(e.spec.uid for e in self._events if isinstance(e, JobSubmitted) and _has_secrets(e.spec))
            # -1: nobody's uid, so every secret is hidden
            self._public = encode_many(redact_events(self._events, -1, ())) if self._owners else self.payload
        assert self._public is not None
        if uid not in self._owners:
            return self._public
        variant = self._variants.get(uid)
        if variant is None:
            variant = self._variants[uid] = encode_many(redact_events(self._events, uid, ()))
        return variant
