"""The mypyc build of the hot path (setup.py, eventsched/_compiled.py) decides
exactly as its Python sources do.

Both builds replay the same workloads under every policy, in processes of
their own (``EVENTSCHED_PURE=1`` makes one import the sources), and must
write the same events: every placement, on the same GPUs, at the same
virtual time, with the same causes.
"""

from __future__ import annotations

import importlib.machinery
import os
import subprocess
import sys
from pathlib import Path

import pytest

from eventsched import _compiled
from eventsched.storage import log as eventlog

ROOT = Path(__file__).resolve().parent.parent
POLICIES = ["fifo", "priority", "best-fit", "sjf-backfill", "fgd", "fair-share"]


def _python(pure: bool, code: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != "EVENTSCHED_PURE"}
    if pure:
        env["EVENTSCHED_PURE"] = "1"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def _built() -> bool:
    return any(_compiled._extension(s) for s in _compiled.SOURCES)


def test_the_hot_path_runs_compiled_where_it_was_built_and_as_source_on_request() -> None:
    if not _built():
        pytest.skip("this install has no compiled modules (built with EVENTSCHED_PURE=1, or no C compiler)")
    code = ("import importlib; from eventsched import _compiled; "
            "[importlib.import_module(m) for m in _compiled.MODULES]; print(' '.join(_compiled.compiled()))")
    assert _python(False, code).split() == list(_compiled.MODULES)
    assert _python(True, code).split() == []


def _replay(out: Path, pure: bool, source: str, gpus: str, config: str | None) -> None:
    argv = ["replay", source, "--gpus", gpus, "--out", str(out)]
    if config:
        argv += ["--config", config]
    for p in POLICIES:
        argv += ["--policy", p]
    _python(pure, f"import sys; from eventsched.cli import main; sys.exit(main({argv!r}))")


@pytest.mark.parametrize("workload", ["synthetic", "multi-tenant"])
def test_compiled_and_source_builds_replay_alike(tmp_path: Path, workload: str) -> None:
    if not _built():
        pytest.skip("this install has no compiled modules: there is one build only")
    here = ROOT / "replays" / workload
    config = str(here / "tenants.toml") if (here / "tenants.toml").exists() else None
    for pure in (False, True):
        _replay(tmp_path / ("source" if pure else "compiled"), pure, str(here / "workload.csv"), "fake:8:81920", config)
    for p in POLICIES:
        compiled = [e for batch in eventlog.read_batches(tmp_path / "compiled" / p / "log") for e in batch]
        source = [e for batch in eventlog.read_batches(tmp_path / "source" / p / "log") for e in batch]
        assert len(compiled) > 4_000, p  # every job submitted, placed, started and ended
        assert compiled == source, p


def test_a_source_edited_after_its_build_is_named_stale(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:

    source = tmp_path / "eventsched" / "core" / "scheduler.py"
    source.parent.mkdir(parents=True)
    source.write_text("x = 1\n")
    ext = source.with_name("scheduler" + importlib.machinery.EXTENSION_SUFFIXES[0])
    ext.write_bytes(b"")
    monkeypatch.setattr(_compiled, "_ROOT", str(tmp_path))
    os.utime(source, (1_000, 1_000))
    os.utime(ext, (2_000, 2_000))
    assert _compiled.stale() == []  # built after its last edit
    os.utime(source, (3_000, 3_000))
    assert _compiled.stale() == ["eventsched/core/scheduler.py"]
    ext.unlink()
    assert _compiled.stale() == []  # nothing compiled: the source is what runs


def test_a_compiled_module_whose_source_left_the_list_counts_as_stale(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A tree built when a module was still compiled keeps its extension,
    which Python would import instead of the source: setup.sh removes it."""
    folder = tmp_path / "eventsched" / "domain"
    folder.mkdir(parents=True)
    (folder / "text.py").write_text("x = 1\n")
    orphan = folder / ("text" + importlib.machinery.EXTENSION_SUFFIXES[0])
    orphan.write_bytes(b"")
    (folder / ("_helper" + importlib.machinery.EXTENSION_SUFFIXES[0])).write_bytes(b"")  # a C helper: no .py beside it
    monkeypatch.setattr(_compiled, "_ROOT", str(tmp_path))
    assert _compiled.orphans() == [str(orphan.relative_to(tmp_path))]
    assert _compiled.stale() == ["eventsched/domain/text.py"]
    orphan.unlink()
    assert _compiled.orphans() == [] and _compiled.stale() == []
