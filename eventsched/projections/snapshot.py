"""The allocation state as snapshots on disk: ``storage.snapshots`` holds the
bytes, ``cluster`` says what they mean."""

from __future__ import annotations

import os
from pathlib import Path

from eventsched.projections.cluster import ClusterState, snapshot_bytes, state_from_snapshot
from eventsched.storage import snapshots

__all__ = ["save", "load_latest", "snapshot_bytes"]


def save(directory: str | os.PathLike[str], state: ClusterState) -> Path:
    """Snapshot ``state`` (which includes events up to ``state.last_seq``)."""
    return snapshots.save_bytes(directory, state.last_seq, snapshot_bytes(state))


def load_latest(directory: str | os.PathLike[str]) -> ClusterState | None:
    """The newest snapshot that reads back whole (corrupt ones are skipped)."""
    return snapshots.load_latest(directory, state_from_snapshot, lambda state: state.last_seq)
