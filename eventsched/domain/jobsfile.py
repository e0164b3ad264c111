"""The jobs file of the schedulers eventsched replaces, one job per line, read as
they read it (README.md, "Jobs files and LLM sizing")::

    # priority,script_path,conda_env,arguments,allowed_gpus
    0,/data3/experiments/evaluate.py,ml_env,--llm qwen2.5-3b-inst --mode test,0-3
    2,/path/to/inference.py,,--llm qwen2.5-32b-inst --batch_size 1,4,5,6,7

- A line is split at its first four commas (the seeds' ``line.split(",", 4)``), so
  everything after the fourth is ``allowed_gpus`` (``4,5,6,7`` works).
- The seeds ran the *lowest* priority first, eventsched the *highest*: P becomes
  ``-P``, keeping the lines' order, and a line at 0 ranks with a plain ``submit``.
- ``--cuda`` is appended to the arguments (any of the line's own dropped) and its
  value written at launch with the assigned GPU ids (the executor's ``rewrite_cuda``).
- A line is known by ``PATH:LINE:SHA`` (``JobSpec.source``; SHA of the stripped
  line): the core refuses a second job for the same user and source, so a file
  read again submits nothing twice, while a line edited in place is a new job.
"""

from __future__ import annotations

import hashlib
import os
import re
import shlex
from dataclasses import dataclass

import msgspec

from eventsched.domain.dedupe import content_key
from eventsched.domain.events import JobSpec
from eventsched.domain.llm import LlmConfig, llm_name
from eventsched.domain.text import has_control
from eventsched.domain.units import UnitError, parse_gpu_ids

__all__ = ["unreported", "JobLine", "LineError", "JobsFileError", "CUDA_PLACEHOLDER", "parse_jobs_text", "parse_line",
           "our_priority", "line_source", "line_command", "line_spec"]

CUDA_PLACEHOLDER = "auto"  # --cuda's value until the launch writes the GPU ids over it
_INT = re.compile(r"[+-]?[0-9]+")
FORMAT = "priority,script_path,conda_env,arguments,allowed_gpus"


class JobsFileError(ValueError):
    """A line that is not a job; ``str()`` is the reason, without FILE:LINE."""


@dataclass(frozen=True)
class JobLine:
    line: int  # 1-based line number
    text: str  # the line, stripped (what its sha covers)
    priority: int  # as written: the seeds' "lower runs first"
    script: str
    conda: str
    args: list[str]
    allowed_gpus: list[int] | None  # None: any GPU
    sha: str  # first 16 hex digits of sha256(text)


@dataclass(frozen=True)
class LineError:
    line: int
    reason: str


def parse_line(text: str, line: int) -> JobLine:
    text = text.strip()
    # undecodable bytes (surrogateescape), or any lone surrogate a caller's str may hold
    if any("\ud800" <= c <= "\udfff" for c in text):
        raise JobsFileError("the line is not valid UTF-8")
    if has_control(text):
        raise JobsFileError("the line holds a control character")
    parts = [p.strip() for p in text.split(",", 4)]
    if len(parts) < 2 or not parts[0] or not parts[1]:
        raise JobsFileError(f"expected {FORMAT} (at least a priority and a script path)")
    parts += [""] * (5 - len(parts))
    priority_text, script, conda, args_text, gpus_text = parts
    if not _INT.fullmatch(priority_text):
        raise JobsFileError(f"priority {priority_text!r} is not a whole number (lower runs first, e.g. 0)")
    priority = int(priority_text)
    if abs(priority) > 1 << 31:
        raise JobsFileError(f"priority {priority} is too large")
    if any(c.isspace() for c in conda):
        raise JobsFileError(f"conda_env {conda!r} is not an environment name")
    try:
        args = shlex.split(args_text)
    except ValueError as exc:
        raise JobsFileError(f"arguments {args_text!r}: {exc}") from None
    allowed: list[int] | None = None
    if gpus_text:
        try:
            allowed = parse_gpu_ids(gpus_text)
        except UnitError:
            raise JobsFileError(f"allowed_gpus {gpus_text!r} is not a list of GPU ids like 0-3, 4,5,6,7 "
                                "or 0-1,4 (empty: any GPU)") from None
    return JobLine(line=line, text=text, priority=priority, script=script, conda=conda, args=args,
                   allowed_gpus=allowed, sha=hashlib.sha256(text.encode("utf-8", "surrogateescape")).hexdigest()[:16])


def unreported(text: str, bad: list[LineError], reported: set[tuple[int, str]]) -> list[LineError]:
    """The bad lines not reported before (by line number and text), now marked reported."""
    lines = text.split("\n") if bad else []
    fresh = [p for p in bad if (p.line, lines[p.line - 1].strip()) not in reported]
    reported.update((p.line, lines[p.line - 1].strip()) for p in fresh)
    return fresh


def parse_jobs_text(text: str) -> tuple[list[JobLine], list[LineError]]:
    """Every job line and every bad line of a jobs file's text.

    Lines are counted at ``\\n`` only (as editors and ``grep -n`` count them);
    a bad line is reported and the others still load."""
    jobs: list[JobLine] = []
    errors: list[LineError] = []
    for number, raw in enumerate(text.split("\n"), start=1):
        stripped = raw.strip()
        if not stripped or stripped.startswith("#"):
            continue
        try:
            jobs.append(parse_line(stripped, number))
        except JobsFileError as exc:
            errors.append(LineError(number, str(exc)))
    return jobs, errors


def our_priority(seed_priority: int) -> int:
    return -seed_priority


def line_source(resolved_path: str, line: JobLine) -> str:
    return f"{resolved_path}:{line.line}:{line.sha}"


def line_command(line: JobLine, folder: str) -> list[str]:
    """``python -u SCRIPT ARGS... --cuda auto``: the seeds' command, as argv."""
    script = line.script if os.path.isabs(line.script) else os.path.normpath(os.path.join(folder, line.script))
    args: list[str] = []
    skip = False
    for arg in line.args:
        if skip:
            skip = False
        elif arg == "--cuda":
            skip = True
        elif not arg.startswith("--cuda="):
            args.append(arg)
    return ["python", "-u", script, *args, "--cuda", CUDA_PLACEHOLDER]


def line_spec(line: JobLine, *, resolved_path: str, llm: LlmConfig, base: JobSpec, dedupe: bool = False) -> JobSpec:
    """The job of ``line``; what the line does not say (identity, environment,
    session) from ``base``. ``dedupe``: keyed as ``submit --dedupe``, whichever
    line or file an identical job came from."""
    command = line_command(line, os.path.dirname(resolved_path))
    return msgspec.structs.replace(
        base, command=command, name=os.path.basename(line.script),
        gpus=llm.gpus(llm_name(line.args)), gpu_ids=line.allowed_gpus, priority=our_priority(line.priority),
        conda=line.conda, source=line_source(resolved_path, line),
        content_hash=content_key(command, base.cwd, line.conda, base.env_setup, base.env) if dedupe else "")
