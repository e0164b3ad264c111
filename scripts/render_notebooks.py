"""Render executed notebooks to Markdown under docs/notebooks/, so that someone
browsing the repository sees their tables, charts and the panel's last view.

The test suite (tests/test_notebooks.py) runs each notebook in notebooks/
against a real daemon and renders it here; by hand, render notebooks already
executed: ``python scripts/render_notebooks.py executed-quickstart.ipynb ...``.
Charts go beside the page as PNG files; a widget is drawn from the widget
state saved with the notebook: the panel as its thread last drew it, rows and
buttons included, not as it was when its cell ran.
"""

from __future__ import annotations

import copy
import html
import re
import sys
from pathlib import Path

import nbformat

DOCS = Path(__file__).resolve().parent.parent / "docs" / "notebooks"
NOTE = ("<!-- rendered from notebooks/{name} by scripts/render_notebooks.py (run by tests/test_notebooks.py); "
        "do not edit -->\n\n")
# what differs from run to run and machine to machine: the temporary state directories
_TMP = re.compile(r"/tmp/[^\s'\"<>)]*?(?=/(?:state|log|notebooks)\b|[\s'\"<>)])")


WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"


def widget_html(state: dict, ref: str) -> str:
    """Static HTML of the widget ``ref`` (``IPY_MODEL_<id>`` or an id) from saved widget state."""
    model = state.get(ref.removeprefix("IPY_MODEL_"))
    if model is None:
        return ""
    s, kind = model["state"], model["model_name"]
    layout = state.get(str(s.get("layout", "")).removeprefix("IPY_MODEL_"), {}).get("state", {})
    if layout.get("display") == "none":
        return ""
    label = html.escape(str(s.get("description", "")))
    if kind in ("HTMLModel", "LabelModel"):
        return str(s.get("value", ""))
    if kind == "ButtonModel":
        return f"<button{' disabled' if s.get('disabled') else ''}>{label}</button>"
    if kind == "FloatProgressModel":
        return f"{label} <progress value='{s.get('value', 0)}' max='{s.get('max', 1)}'></progress>"
    if kind == "DropdownModel":
        labels, i = s.get("_options_labels", []), s.get("index")
        return f"<p>{label}: {html.escape(labels[i]) if i is not None and i < len(labels) else ''}</p>"
    inner = "".join(widget_html(state, c) for c in s.get("children", []))
    return f"<div style='display:flex'>{inner}</div>" if kind == "HBoxModel" else f"<div>{inner}</div>"


def _freeze_widgets(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """A copy of ``nb`` whose widget outputs are HTML drawn from the saved widget state."""
    state = nb.metadata.get("widgets", {}).get("application/vnd.jupyter.widget-state+json", {}).get("state")
    if not state:
        return nb
    nb = copy.deepcopy(nb)
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            view = out.get("data", {}).get(WIDGET_VIEW)
            if view and view.get("model_id") in state:
                out["data"] = {"text/html": widget_html(state, view["model_id"])}
    return nb


def render(nb: nbformat.NotebookNode, name: str, out_dir: Path = DOCS) -> Path:
    """``nb`` (executed) as ``out_dir/<stem>.md`` with its images in ``<stem>_files/``."""
    from nbconvert import MarkdownExporter

    stem = Path(name).stem
    exporter = MarkdownExporter()
    exporter.exclude_input_prompt = exporter.exclude_output_prompt = True
    body, resources = exporter.from_notebook_node(_freeze_widgets(nb), resources={"output_files_dir": f"{stem}_files"})
    out_dir.mkdir(parents=True, exist_ok=True)
    files = out_dir / f"{stem}_files"
    for old in files.glob("*") if files.is_dir() else ():
        old.unlink()  # the last run's charts, by their old names
    for rel, data in resources.get("outputs", {}).items():
        target = out_dir / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
    page = out_dir / f"{stem}.md"
    page.write_text(NOTE.format(name=name) + _TMP.sub("/tmp/…", body))
    return page


def main(paths: list[str]) -> int:
    if not paths:
        print("usage: render_notebooks.py EXECUTED.ipynb ...", file=sys.stderr)
        return 2
    for path in paths:
        name = Path(path).name.removeprefix("executed-")
        print(render(nbformat.read(path, as_version=4), name))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
