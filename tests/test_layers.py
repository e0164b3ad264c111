"""The layers of DESIGN.md, enforced by import-linter (contracts in pyproject.toml)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def lint(cwd: Path, pythonpath: Path) -> subprocess.CompletedProcess:
    code = "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"
    env = {**os.environ, "PYTHONPATH": str(pythonpath)}
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def test_every_import_goes_down_the_layers() -> None:
    result = lint(ROOT, ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert "eventsched layers KEPT" in result.stdout and "runtime layers KEPT" in result.stdout


def test_a_planted_wrong_way_import_breaks_the_contract(tmp_path: Path) -> None:
    shutil.copytree(ROOT / "eventsched", tmp_path / "eventsched", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    # the domain reaching up into the daemon: what the contract exists to stop
    (tmp_path / "eventsched" / "domain" / "planted.py").write_text("from eventsched.runtime import engine\n")
    result = lint(tmp_path, tmp_path)
    assert result.returncode != 0
    assert "eventsched layers BROKEN" in result.stdout
    assert "eventsched.domain.planted -> eventsched.runtime.engine" in result.stdout


def test_no_module_imports_itself_back() -> None:
    """No import cycles, type-only imports (``if TYPE_CHECKING:``) counted
    too: each module can be read knowing only the ones it imports."""
    import grimp

    graph = grimp.build_graph("eventsched", exclude_type_checking_imports=False)
    cycles = sorted(
        (module, dep)
        for module in graph.modules
        for dep in graph.find_modules_directly_imported_by(module)
        if module < dep and graph.chain_exists(importer=dep, imported=module)
    )
    assert cycles == []
