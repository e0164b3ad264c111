"""The mypyc build of the hot path (setup.py, eventsched/_compiled.py) decides
exactly as its Python sources do, and is the build that runs where it is
built and up to date.

Both builds replay the same workloads under every policy, in processes of
their own (``EVENTSCHED_PURE=1`` makes one import the sources), and must
write the same events: every placement, on the same GPUs, at the same
virtual time, with the same causes.

In CI (``CI=true``, .ci/run) every compiled module and C helper must be built,
up to date and loaded: a missing or stale part fails. Elsewhere those tests
skip, saying what is missing.
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
# the C helpers setup.py builds beside their sources (their importers fall back to Python without them)
HELPERS = {"eventsched.runtime.launch._spawn": "eventsched/runtime/launch/_spawn.c",
           "eventsched.projections._frames": "eventsched/projections/_frames.c"}
CI = os.environ.get("CI", "").lower() in ("true", "1")


def _python(pure: bool, code: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "EVENTSCHED_PURE"}
    if pure:
        env["EVENTSCHED_PURE"] = "1"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc


def _missing() -> list[str]:
    """What keeps the compiled build from being the one that runs."""
    out = [f"{s} is not compiled" for s in _compiled.SOURCES if _compiled._extension(s) is None]
    out += [f"{s} is newer than its compiled module" for s in _compiled.stale()]
    for source in HELPERS.values():
        ext = _compiled._extension(source.removesuffix(".c") + ".py")
        if ext is None:
            out.append(f"{source} is not built")
        elif os.path.getmtime(ROOT / source) > os.path.getmtime(ext):
            out.append(f"{source} is newer than its build")
    return out


def _needs_the_compiled_build() -> None:
    if missing := _missing():
        message = "the compiled build is not complete (run scripts/setup.sh): " + "; ".join(missing)
        if CI:
            pytest.fail(message)
        pytest.skip(message)


def test_the_compiled_build_runs_where_it_was_built_and_the_sources_on_request() -> None:
    _needs_the_compiled_build()
    code = ("import importlib, sys; from eventsched import _compiled; "
            "[importlib.import_module(m) for m in _compiled.MODULES]; print(' '.join(_compiled.compiled()))")
    proc = _python(False, code)
    assert proc.stdout.split() == list(_compiled.MODULES) and proc.stderr == ""
    assert _python(True, code).stdout.split() == []
    helpers = ("import importlib, importlib.machinery as m; "
               f"print(all(isinstance(importlib.import_module(n).__spec__.loader, m.ExtensionFileLoader) for n in {list(HELPERS)!r}))")
    assert _python(False, helpers).stdout.split() == ["True"]


def _replay(out: Path, pure: bool, source: str, gpus: str, config: str | None) -> None:
    argv = ["replay", source, "--gpus", gpus, "--out", str(out)]
    if config:
        argv += ["--config", config]
    for p in POLICIES:
        argv += ["--policy", p]
    _python(pure, f"import sys; from eventsched.cli import main; sys.exit(main({argv!r}))")


@pytest.mark.parametrize("workload", ["synthetic", "multi-tenant"])
def test_compiled_and_source_builds_replay_alike(tmp_path: Path, workload: str) -> None:
    _needs_the_compiled_build()
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


def test_a_stale_build_is_bypassed_whole_and_said_once(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """One compiled module older than its source: every compiled module is
    imported from its source (compiled ones reach into each other's
    classes), with one line on stderr; other modules are left alone."""
    monkeypatch.setattr(_compiled, "stale", lambda: ["eventsched/projections/live.py"])
    monkeypatch.setattr(_compiled, "orphans", lambda: ["eventsched/domain/text.cpython-311-x86_64-linux-gnu.so"])
    finder = _compiled._Sources(pure=False)
    assert finder.find_spec("eventsched.cli", None) is None  # not a compiled module: nothing checked yet
    assert capsys.readouterr().err == ""
    for name in ("eventsched.core.scheduler", "eventsched.projections.live", "eventsched.domain.text"):
        spec = finder.find_spec(name, None)
        assert spec is not None and spec.origin == str(ROOT / (name.replace(".", "/") + ".py"))
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "eventsched/projections/live.py" in err and "scripts/setup.sh" in err
    assert finder.find_spec("eventsched.cli", None) is None


def test_an_up_to_date_build_runs_and_pure_asks_for_the_sources(monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(_compiled, "stale", lambda: [])
    assert _compiled._Sources(pure=False).find_spec("eventsched.core.scheduler", None) is None
    spec = _compiled._Sources(pure=True).find_spec("eventsched.core.scheduler", None)
    assert spec is not None and spec.origin == str(ROOT / "eventsched" / "core" / "scheduler.py")
    assert capsys.readouterr().err == ""
