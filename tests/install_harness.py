"""One run of scripts/install-system.sh per test session, started early in the
background (tests/conftest.py) and awaited by the test that uses it."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_install: tuple[Path, subprocess.Popen[bytes]] | None = None


def start_install() -> None:
    """Install into a fresh PREFIX under a world-readable temporary folder."""
    global _install
    if _install is not None:
        return
    top = Path(tempfile.mkdtemp(prefix="es-install-"))
    top.chmod(0o755)
    output = (top / "install.out").open("wb")
    # at the lowest CPU and I/O priority: its minutes of compiling fill the
    # cores the other tests leave idle instead of slowing them down
    process = subprocess.Popen(["nice", "-n", "19", "ionice", "-c", "3", "scripts/install-system.sh"], cwd=ROOT,
                               env={**os.environ, "PREFIX": str(top / "usr")},
                               stdout=output, stderr=subprocess.STDOUT, start_new_session=True)
    output.close()
    _install = top, process


def finished_install(timeout: float = 600) -> tuple[Path, int, str]:
    """(the install's top folder, its exit status, its output), once it is done."""
    start_install()
    assert _install is not None
    top, process = _install
    code = process.wait(timeout)
    return top, code, (top / "install.out").read_text(errors="replace")


def discard_install() -> None:
    global _install
    if _install is None:
        return
    top, process = _install
    if process.poll() is None:
        os.killpg(process.pid, 9)
        process.wait()
    shutil.rmtree(top, ignore_errors=True)
    _install = None
