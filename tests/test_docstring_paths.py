"""Every repository path named in a comment or docstring of ``eventsched/``
exists, so that a pointer to a doc, a benchmark or a module can be followed:
``docs/x.md``, ``bench/y.py``, ``runtime/launch/executor.py`` (from the
repository root, from ``eventsched/`` or from the naming module's package),
any ``*.md`` (a document outside the repository is no pointer), and dotted
``eventsched.x.y`` names (a module, or an attribute of one)."""

from __future__ import annotations

import ast
import importlib
import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "eventsched"
_TOP = "eventsched|docs|bench|tests|scripts|notebooks|replays|contrib|\\.ci"
_SUB = "|".join(sorted(p.name for p in PACKAGE.iterdir() if p.is_dir() and not p.name.startswith(("_", "."))))
_SUFFIX = "py|md|c|h|sh|json|toml|ipynb|txt|yml|yaml|csv"
# a folder of the repository or a subpackage, a slash, then a file with a known
# suffix or a folder's trailing slash
PATH = re.compile(rf"(?<![\w./~-])((?:{_TOP}|{_SUB})/(?:[\w.-]+/)*(?:[\w.-]+\.(?:{_SUFFIX})\b|(?=[\s`'\")])))")
DOC = re.compile(r"(?<![\w.-])([\w.~/-]*[\w-]\.md)\b")  # any document, wherever it says it is
DOTTED = re.compile(r"(?<![\w./])eventsched((?:\.[A-Za-z_]\w*)+)")


def _texts(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every comment and docstring in ``path``."""
    source = path.read_text(encoding="utf-8")
    if path.suffix == ".c":
        return [(source.count("\n", 0, m.start()) + 1, m.group())
                for m in re.finditer(r"/\*.*?\*/|//[^\n]*", source, re.S)]
    out = [(t.start[0], t.string) for t in tokenize.generate_tokens(io.StringIO(source).readline)
           if t.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                out.append((node.body[0].lineno, doc))
    return out


def _exists(named: str, where: Path) -> bool:
    """Is ``named`` a file or folder of the repository, seen from the root,
    from ``eventsched/`` or from the package (or its parent) of ``where``?"""
    named = named.rstrip("/")
    if named.startswith(("/", "~")):
        return False
    return any((base / named).exists() for base in (ROOT, PACKAGE, where.parent, where.parent.parent))


def _resolves(dotted: str) -> bool:
    """``eventsched.a.b.c``: the longest importable module, then attributes."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        name = ".".join(parts[:i])
        try:
            obj = importlib.import_module(name)
        except ImportError:
            continue
        try:
            for attr in parts[i:]:
                obj = getattr(obj, attr)
        except AttributeError:
            return False
        return True
    return False


def named() -> list[tuple[str, int, str, bool]]:
    """(file, line, name, found) for every pointer in the package's comments and docstrings."""
    found = []
    for path in sorted(PACKAGE.rglob("*")):
        if path.suffix not in (".py", ".c") or "__pycache__" in path.parts:
            continue
        file = str(path.relative_to(ROOT))
        for line, text in _texts(path):
            at = lambda m: line + text.count("\n", 0, m.start())  # noqa: E731
            for m in PATH.finditer(text):
                found.append((file, at(m), m.group(1), _exists(m.group(1), path)))
            for m in DOC.finditer(text):
                found.append((file, at(m), m.group(1), _exists(m.group(1), path)))
            for m in DOTTED.finditer(text):
                found.append((file, at(m), m.group(), _resolves(m.group())))
    return found


def test_the_patterns_find_pointers() -> None:
    assert PATH.findall("see docs/fair-share.md, bench/bench_log.py and runtime/launch/_spawn.c.") == [
        "docs/fair-share.md", "bench/bench_log.py", "runtime/launch/_spawn.c"]
    assert PATH.findall("a ~/.eventsched/log dir, http://x/docs/a.md, 1/2") == []
    assert DOC.findall("see /elsewhere/NOTES.md and README.md.") == ["/elsewhere/NOTES.md", "README.md"]
    assert not _exists("/elsewhere/NOTES.md", PACKAGE / "x.py") and _exists("README.md", PACKAGE / "x.py")
    assert _resolves("eventsched.history") and _resolves("eventsched.sim.static_sim.main")
    assert not _resolves("eventsched.static_sim")


def test_every_named_path_exists() -> None:
    pointers = named()
    assert len(pointers) > 10  # the scan sees the package's pointers at all
    missing = [f"{file}:{line}: {name}" for file, line, name, found in pointers if not found]
    assert not missing, "named in comments or docstrings, but not in the repository:\n" + "\n".join(missing)
