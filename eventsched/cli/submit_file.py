"""``eventsched submit-file FILE``: the seeds' jobs file (``domain/jobsfile.py``),
all its lines over one connection, and the ``llm_config.json`` lookup shared
with ``submit``. A bad line is ``FILE:LINE: reason`` on stderr (exit status 1);
a line the daemon already has (same ``PATH:LINE:SHA`` source) is skipped.
``--watch`` holds back a last line without its newline until the file stands
still, so a half-written line is never submitted.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from eventsched.domain.jobsfile import line_source, line_spec, parse_jobs_text, unreported
from eventsched.domain.llm import (DEFAULT_LLM_CONFIG, LLM_CONFIG_NAME, LlmConfig, LlmConfigError, llm_name,
                                  parse_llm_config)
from eventsched.domain.text import print_json
from eventsched.domain.units import UnitError

if TYPE_CHECKING:
    from eventsched.domain.events import JobSpec
    from eventsched.wire.client import Client

__all__ = ["cmd_submit_file", "find_llm_config", "llm_sized", "MAX_FILE_BYTES", "WATCH_INTERVAL_S"]

MAX_FILE_BYTES = 64 << 20
WATCH_INTERVAL_S = 0.5


class FileProblem(UnitError):
    """A file the user named cannot be used: one line (``main`` prints it), exit status 2."""


def _read(path: str, what: str, too_large: str) -> bytes:
    """The file at ``path``, or FileProblem: it cannot be read (as ``what``) or is ``too_large``."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise FileProblem(f"cannot read {what}: {exc.strerror or exc}") from None
    if len(data) > MAX_FILE_BYTES:
        raise FileProblem(too_large)
    return data


def _read_llm(path: str) -> LlmConfig:
    data = _read(path, f"the LLM config {path}", f"{path}: larger than {MAX_FILE_BYTES >> 20} MiB; not an LLM config")
    try:
        return parse_llm_config(data, path)
    except LlmConfigError as exc:
        raise FileProblem(str(exc)) from None


def find_llm_config(explicit: str | None, state_dir: str | None) -> LlmConfig:
    """``explicit``, else ``./llm_config.json``, else the state directory's, else the default."""
    if explicit:
        return _read_llm(explicit)
    from eventsched.domain.paths import state_dir_location

    for candidate in (LLM_CONFIG_NAME, os.path.join(state_dir or state_dir_location(), LLM_CONFIG_NAME)):
        if os.path.isfile(candidate):
            return _read_llm(candidate)
    return DEFAULT_LLM_CONFIG


def llm_sized(args: argparse.Namespace, command: list[str], spec: JobSpec) -> JobSpec:
    """``--llm NAME`` in ``submit``'s command sets ``gpus`` from llm_config.json, unless ``--gpus`` did."""
    if args.gpus is not None:
        return spec
    words = command[1:]
    if len(command) == 1 and " " in command[0]:  # one shell string (run through sh -c)
        import shlex

        try:
            words = shlex.split(command[0])[1:]
        except ValueError:
            words = []
    name = llm_name(words)
    if name is None:
        return spec
    import msgspec

    llm = find_llm_config(args.llm_config, args.state_dir)
    return msgspec.structs.replace(spec, gpus=llm.gpus(name))


@dataclass
class Outcome:
    ids: list[int] = field(default_factory=list)
    skipped: list[dict[str, int]] = field(default_factory=list)
    errors: list[dict[str, int | str]] = field(default_factory=list)


@dataclass
class JobsFile:
    """One jobs file being submitted (once, or followed)."""

    shown: str  # the path as the user wrote it (in FILE:LINE messages)
    resolved: str  # the path in every line's source
    llm: LlmConfig
    base: JobSpec
    dedupe: bool = False  # --dedupe: a line identical to a waiting, running or succeeded job is skipped
    known: set[str] = field(default_factory=set)  # sources sent to the daemon: not sent again
    reported: set[tuple[int, str]] = field(default_factory=set)  # bad lines reported: (line number, text)

    def read(self) -> str:
        data = _read(self.shown, f"jobs file {self.shown}", f"jobs file {self.shown} is larger than {MAX_FILE_BYTES >> 20} MiB")
        return data.decode("utf-8", "surrogateescape")

    def error(self, outcome: Outcome, line: int, reason: str) -> None:
        print(f"{self.shown}:{line}: {reason}", file=sys.stderr, flush=True)
        outcome.errors.append({"line": line, "reason": reason})

    def submit(self, c: Client, text: str, *, announce: bool) -> Outcome:
        """Submit every line of ``text`` not sent before; report bad lines once each."""
        outcome = Outcome()
        jobs, bad = parse_jobs_text(text)
        for problem in unreported(text, bad, self.reported):
            self.error(outcome, problem.line, problem.reason)
        fresh = [job for job in jobs if line_source(self.resolved, job) not in self.known]
        if not fresh:
            return outcome
        specs = [line_spec(job, resolved_path=self.resolved, llm=self.llm, base=self.base, dedupe=self.dedupe)
                 for job in fresh]
        results = c.submit_each(specs)
        for job, spec, result in zip(fresh, specs, results):
            self.known.add(spec.source)
            if isinstance(result, int):
                outcome.ids.append(result)
                if announce:
                    print(result, flush=True)
                continue
            if result.existing is not None:  # submitted before (the core knows each line's source), or a duplicate
                outcome.skipped.append({"line": job.line, "id": result.existing})
            else:
                self.error(outcome, job.line, str(result))
        return outcome


def _fingerprint(path: str) -> tuple[int, ...] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _base_spec(session: str) -> JobSpec:
    from eventsched.domain import rlimits
    from eventsched.domain.events import JobSpec

    # like `eventsched submit`: the caller's environment, folder, umask and limits
    return JobSpec(command=["python"], cwd=os.getcwd(), env=dict(os.environ),
                   umask=rlimits.current_umask(), rlimits=rlimits.current(), session=session)


def cmd_submit_file(args: argparse.Namespace) -> int:
    from eventsched.cli.connect import client

    with client(args) as c:
        llm = find_llm_config(args.llm_config, args.state_dir)  # FileProblem: one line, exit 2
        jobs = JobsFile(shown=args.file, resolved=os.path.realpath(args.file), llm=llm,
                        base=_base_spec(args.session or ""), dedupe=args.dedupe)
        outcome = jobs.submit(c, jobs.read(), announce=not args.json)
        failed = bool(outcome.errors)
        if args.json:
            if args.watch:
                print(json.dumps(asdict(outcome)), flush=True)
            else:
                print_json(asdict(outcome))
        elif outcome.skipped:
            n = len(outcome.skipped)
            why = "already submitted" + (" or identical to a queued, running or succeeded job" if args.dedupe else "")
            print(f"eventsched: {n} line{'s' if n != 1 else ''} of {args.file} {why}; skipped", file=sys.stderr)
        if args.watch:
            failed = _watch(args, c, jobs) or failed
        return 1 if failed else 0


def _watch(args: argparse.Namespace, c: Client, jobs: JobsFile) -> bool:
    """Follow the file until Ctrl-C; True if a bad line was reported meanwhile."""
    from eventsched.wire.client import ClientError

    failed = False
    seen = _fingerprint(args.file)
    held = False  # a last line without its newline waits for the file to stand still
    trouble = ""  # the last problem reported (reported once, until it changes)

    def report(problem: str) -> None:
        nonlocal trouble
        if problem != trouble:
            print(problem, file=sys.stderr, flush=True)
            trouble = problem

    try:
        while True:
            time.sleep(WATCH_INTERVAL_S)
            now = _fingerprint(args.file)
            if now == seen and not held:
                continue
            complete = now == seen  # unchanged since the last look: a held line is whole
            seen = now
            if now is None:
                report(f"eventsched: {args.file} is gone; waiting for it to come back")
                continue
            try:
                text = jobs.read()
            except FileProblem as exc:
                report(f"eventsched: {exc}")
                continue
            held = not complete and bool(text) and not text.endswith("\n")
            if held:
                text = text[: text.rfind("\n") + 1]
            try:
                outcome = jobs.submit(c, text, announce=not args.json)
            except (ClientError, OSError) as exc:
                report(f"eventsched: {exc}; still watching {args.file}")
                seen = None  # try again at the next look
                continue
            trouble = ""
            failed = failed or bool(outcome.errors)
            if args.json and (outcome.ids or outcome.skipped or outcome.errors):
                print(json.dumps(asdict(outcome)), flush=True)
    except KeyboardInterrupt:  # Ctrl-C is how watching ends
        return failed
