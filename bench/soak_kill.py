"""Hundreds of kills: kill -9 the daemon at random moments of a
submission storm, restart it, and check that nothing was lost.

Each round, against one real daemon on fake GPUs (its state kept across all
rounds, with a small segment size and a short snapshot interval so that
segment rotations and snapshots are in flight when the kill lands):

1. several client *processes* submit jobs as fast as they can and append
   every id the daemon acknowledged to their own file;
2. every job appends its id to a shared runs file, sleeps a little, and exits
   with ``id % 5``;
3. at a random moment, maybe first one of: kill -9 the launch zygote, a job's
   supervisor, or a job's process group (the daemon must stay up and record
   the job as failed or lost, with a reason, never run it again) -- then
   kill -9 the daemon, and stop the clients;
4. restart the daemon, wait for every job to end, and check: every
   acknowledged id is in the queue; no job ran twice (runs file); every job
   that ran to its end has the exit code its id implies; ``eventsched log
   verify`` passes; the DuckDB read model caught up incrementally across the
   kills (``History.catch_up``) equals a fold of the whole log from scratch,
   table by table; the daemon never printed a traceback.

Run (the long soak, figures in docs/reliability.md):

    .venv/bin/python bench/soak_kill.py --rounds 200

tests/test_kill_soak.py runs a handful of rounds through ``run_soak``.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
PYTHON = sys.executable
TERMINAL = {"succeeded", "failed", "cancelled", "lost"}

# Starts the daemon with a small segment size and a short snapshot interval
# (neither is a config key: they are Engine arguments with production defaults).
_SHIM = """
import sys
from eventsched.runtime import engine
engine.Engine.__init__.__kwdefaults__.update(snapshot_every=int(sys.argv.pop(1)), segment_bytes=int(sys.argv.pop(1)))
from eventsched.cli import main
raise SystemExit(main())
"""

# A job: record that it ran, run briefly, exit with a code its id implies.
_JOB = 'echo "$EVENTSCHED_JOB_ID" >> {runs}; sleep 0.$((EVENTSCHED_JOB_ID % 4)); exit $((EVENTSCHED_JOB_ID % 5))'

# ``--client``: one submitting process (see ``_client_main``).


def expected_exit(job: int) -> int:
    return job % 5


@dataclass
class Figures:
    rounds: int = 0
    daemon_kills: int = 0
    component_kills: dict[str, int] = field(default_factory=lambda: collections.Counter())
    acknowledged: int = 0
    jobs_checked: int = 0
    jobs_by_state: dict[str, int] = field(default_factory=lambda: collections.Counter())
    lost_acknowledged: int = 0
    ran_twice: int = 0
    wrong_exit: int = 0
    verify_failures: int = 0
    model_mismatches: int = 0
    tracebacks: int = 0
    client_errors: dict[str, int] = field(default_factory=lambda: collections.Counter())
    restart_s: list[float] = field(default_factory=list)
    segments: int = 0
    snapshots_on_disk: int = 0
    log_events: int = 0
    problems: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        restart = sorted(self.restart_s) or [0.0]
        out = {k: v for k, v in self.__dict__.items() if k != "restart_s"}
        out["restart_p50_s"] = round(restart[len(restart) // 2], 3)
        out["restart_max_s"] = round(restart[-1], 3)
        out["problems"] = self.problems[:20]
        return out


class SoakDaemon:
    def __init__(self, state: Path, *, gpus: str, snapshot_every: int, segment_bytes: int) -> None:
        self.state = state
        self.socket = state / "eventsched.sock"
        self.gpus = gpus
        self.snapshot_every = snapshot_every
        self.segment_bytes = segment_bytes
        self.process: subprocess.Popen[bytes] | None = None

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["EVENTSCHED_STATE_DIR"] = str(self.state)
        env.pop("EVENTSCHED_SOCKET", None)
        env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
        return env

    def start(self, timeout: float = 60.0) -> float:
        self.state.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        with open(self.state / "daemon.stderr", "ab") as err:
            self.process = subprocess.Popen(
                [PYTHON, "-c", _SHIM, str(self.snapshot_every), str(self.segment_bytes), "serve",
                 "--gpus", self.gpus, "--sample-interval", "0.2"],
                env=self.env(), stdout=err, stderr=err, start_new_session=True,
            )
        from eventsched.wire.client import Client

        while time.monotonic() - t0 < timeout:
            if self.process.poll() is not None:
                raise RuntimeError(f"daemon exited with {self.process.returncode}: {self.stderr()[-2000:]}")
            try:
                with Client(self.socket, timeout=5) as c:
                    c.ping()
                return time.monotonic() - t0
            except Exception:
                time.sleep(0.02)
        raise RuntimeError(f"daemon did not answer within {timeout}s")

    def alive(self) -> bool:
        from eventsched.wire.client import Client

        if self.process is None or self.process.poll() is not None:
            return False
        try:
            with Client(self.socket, timeout=10) as c:
                c.ping()
            return True
        except Exception:
            return False

    def kill9(self) -> None:
        assert self.process is not None
        self.process.kill()
        self.process.wait()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def stderr(self) -> str:
        try:
            return (self.state / "daemon.stderr").read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def jobs(self) -> dict[int, dict[str, Any]]:
        from eventsched.wire.client import Client

        with Client(self.socket, timeout=30) as c:
            return {j["id"]: j for j in c.jobs(all=True)}

    def explain(self, job: int) -> dict[str, Any]:
        from eventsched.wire.client import Client

        with Client(self.socket, timeout=30) as c:
            return c.explain(job)


# -- the clients ---------------------------------------------------------------


def _client_main(socket: str, ack_file: str, stop_file: str, runs: str, seed: int) -> None:
    """Submit until ``stop_file`` appears; every acknowledged id goes to ``ack_file``
    (flushed before the next request, so the file is a lower bound of what the
    daemon acknowledged to this process). Errors are counted by their first words."""
    from eventsched.domain.events import JobSpec
    from eventsched.wire.client import Client
    from eventsched.wire.errors import ClientError

    rng = random.Random(seed)
    command = ["/bin/sh", "-c", _JOB.format(runs=runs)]
    errors: collections.Counter[str] = collections.Counter()
    with open(ack_file, "a") as ack:
        client = Client(socket, timeout=10)
        while not os.path.exists(stop_file):
            specs = [JobSpec(command=command, gpus=rng.choice([0.25, 0.5, 1.0]), name=f"soak{seed}")
                     for _ in range(rng.choice([1, 1, 1, 4]))]
            try:
                ids = [client.submit(specs[0])] if len(specs) == 1 else client.submit_many(specs)
            except (ClientError, OSError) as exc:
                errors[" ".join(str(exc).split()[:5])] += 1
                client.close()
                time.sleep(0.03)
                continue
            ack.write("".join(f"{i}\n" for i in ids))
            ack.flush()
            time.sleep(rng.uniform(0.01, 0.08))
        client.close()
    with open(ack_file + ".errors", "w") as out:
        json.dump(dict(errors), out)


# -- the checks ----------------------------------------------------------------


def _read_ids(path: Path) -> list[int]:
    try:
        return [int(line) for line in path.read_text().split()]
    except FileNotFoundError:
        return []


def _running_attempts(state: Path) -> list[tuple[int, dict[str, Any]]]:
    """(job, pid record) of every attempt that has started and not ended."""
    out = []
    jobs_dir = state / "jobs"
    names = [n.split(".") for n in os.listdir(jobs_dir)] if jobs_dir.is_dir() else []
    # attempt records are jobs/ID.N (not ID.log, ID.N.spec.json)
    tries = sorted((int(n[0]), n[1]) for n in names if len(n) == 2 and n[0].isdigit() and n[1].isdigit())
    for job, attempt in tries[-200:]:  # the newest: the others ended long ago (and a scan of all grows with the soak)
        try:  # a pid line and no exit line yet (runtime/launch/supervisor.py)
            records = [json.loads(line) for line in (jobs_dir / f"{job}.{attempt}").read_text().splitlines()]
        except (ValueError, OSError):
            continue
        started = [r for r in records if "pid" in r]
        if started and not any("exit_code" in r for r in records):
            out.append((job, started[0]))
    return out


def _zygote_pid(daemon_pid: int) -> int | None:
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(b")") + 2:].split()[1])
        if ppid == daemon_pid and b"--zygote" in argv:
            return int(entry)
    return None


def kill_component(kind: str, daemon: SoakDaemon, rng: random.Random) -> int | None:
    """kill -9 one part under the daemon; returns the job it hit (None: the zygote or nothing)."""
    assert daemon.process is not None
    if kind == "zygote":
        pid = _zygote_pid(daemon.process.pid)
        if pid is None:
            return None
        os.kill(pid, signal.SIGKILL)
        return -1
    running = _running_attempts(daemon.state)
    if not running:
        return None
    job, record = rng.choice(running)
    try:
        if kind == "supervisor":
            os.kill(record["supervisor_pid"], signal.SIGKILL)
        else:  # the job's process group
            os.killpg(record["pid"], signal.SIGKILL)
    except ProcessLookupError:
        return None  # it ended on its own just now
    return job


def model_matches_rebuild(state: Path) -> str:
    """"" when the read model, caught up incrementally, equals a fold of the whole log."""
    import duckdb

    from eventsched.projections.history import History
    from eventsched.projections.history_fold import ensure_schema, fold, position
    from eventsched.projections.history_schema import TABLES
    from eventsched.storage.log import read_batches

    History(state).catch_up()
    kept = duckdb.connect(str(state / "history.duckdb"), read_only=True)
    # the daemon is still appending (GPU samples): rebuild exactly the prefix the kept model holds,
    # through the other path (decoded events, not the frame walker): the two must agree
    upto = position(kept)
    fresh = duckdb.connect(":memory:")
    ensure_schema(fresh)
    prefix = ([e for e in batch if e.seq <= upto] for batch in read_batches(state / "log", 1))
    fold(fresh, (batch for batch in prefix if batch), 0)
    try:
        for table in TABLES:
            a = kept.execute(f"SELECT * FROM {table} ORDER BY ALL").fetchall()
            b = fresh.execute(f"SELECT * FROM {table} ORDER BY ALL").fetchall()
            if a != b:
                return f"table {table}: {len(a)} rows kept vs {len(b)} rebuilt; first difference " \
                       f"{next((x, y) for x, y in zip(a + [None] * len(b), b + [None] * len(a)) if x != y)}"
    finally:
        kept.close()
        fresh.close()
    return ""


def log_verify(state: Path) -> tuple[bool, str]:
    r = subprocess.run([PYTHON, "-m", "eventsched.cli", "log", "verify", str(state / "log")],
                       capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    return r.returncode == 0, (r.stdout + r.stderr).strip()


def _wait_all_ended(daemon: SoakDaemon, timeout: float) -> dict[int, dict[str, Any]]:
    deadline = time.monotonic() + timeout
    while True:
        jobs = daemon.jobs()
        if all(j["state"] in TERMINAL for j in jobs.values()) or time.monotonic() > deadline:
            return jobs
        time.sleep(0.2)


def _reason_of(daemon: SoakDaemon, job: int) -> str:
    """The story's text for one job (what ``explain`` shows a user)."""
    return json.dumps(daemon.explain(job))


# -- one soak --------------------------------------------------------------------


def run_soak(workdir: Path, rounds: int, *, seed: int = 1, clients: int = 3, gpus: str = "fake:4:16384",
             snapshot_every: int = 40, segment_bytes: int = 32 << 10, component_every: int = 3,
             max_storm_s: float = 1.5, model_every: int = 1,
             log: Callable[[str], object] | None = print) -> Figures:
    """Run ``rounds`` kill rounds in ``workdir``; every check's failure is one line in ``problems``.

    Every ``component_every``-th round also kills the zygote, a supervisor or
    a job's process group (in turn) before the daemon."""
    rng = random.Random(seed)
    figures = Figures()
    state = workdir / "state"
    runs = workdir / "runs"
    runs.touch()
    daemon = SoakDaemon(state, gpus=gpus, snapshot_every=snapshot_every, segment_bytes=segment_bytes)
    acked: set[int] = set()
    victims: dict[int, str] = {}  # job -> what was killed under it
    checked_ok: set[int] = set()
    kinds = ["job-group", "supervisor", "zygote"]
    t_start = time.monotonic()
    daemon.start()
    try:
        for rnd in range(rounds):
            stop = workdir / f"stop{rnd}"
            procs = []
            for c in range(clients):
                procs.append(subprocess.Popen(
                    [PYTHON, __file__, "--client", str(daemon.socket), str(workdir / f"ack{rnd}.{c}"), str(stop),
                     str(runs), str(seed * 100_000 + rnd * 10 + c)],
                    env=daemon.env(),
                ))
            storm = rng.uniform(0.2, max_storm_s)
            component = kinds[(rnd // component_every) % 3] if component_every and rnd % component_every == 0 else ""
            if component:
                time.sleep(storm / 2 + 0.3)  # let some jobs start
                hit = kill_component(component, daemon, rng)
                wait_until = time.monotonic() + 3.0
                while hit is None and time.monotonic() < wait_until:  # no job running yet: wait for one
                    time.sleep(0.05)
                    hit = kill_component(component, daemon, rng)
                if hit is not None:
                    figures.component_kills[component] += 1
                    if hit > 0:
                        victims[hit] = component
                    time.sleep(0.3)
                    if not daemon.alive():
                        figures.problems.append(f"round {rnd}: the daemon died after its {component} was killed")
                time.sleep(storm / 2)
            else:
                if rnd % 4 == 1:  # the read model catches up while the storm goes on
                    time.sleep(storm / 2)
                    try:
                        from eventsched.projections.history import History

                        History(state, lock_timeout_s=2).catch_up()
                    except Exception as exc:  # noqa: BLE001 - any failure is a finding
                        figures.problems.append(f"round {rnd}: catch-up during the storm failed: {exc!r}")
                    time.sleep(storm / 2)
                else:
                    time.sleep(storm)
            daemon.kill9()
            figures.daemon_kills += 1
            time.sleep(rng.uniform(0, 0.1))  # clients meet a dead daemon
            stop.touch()
            for p in procs:
                if p.wait(60) != 0:
                    figures.problems.append(f"round {rnd}: a client exited with {p.returncode}")
            for c in range(clients):
                acked.update(_read_ids(workdir / f"ack{rnd}.{c}"))
                try:
                    for said, n in json.loads((workdir / f"ack{rnd}.{c}.errors").read_text()).items():
                        figures.client_errors[said] += n
                except FileNotFoundError:
                    pass
            try:
                figures.restart_s.append(daemon.start())
            except RuntimeError as exc:
                figures.problems.append(f"round {rnd}: restart failed: {exc}")
                break
            jobs = _wait_all_ended(daemon, timeout=120)
            stuck = [j for j, job in jobs.items() if job["state"] not in TERMINAL]
            if stuck:
                figures.problems.append(f"round {rnd}: jobs not ended after 120 s: {stuck[:10]}")
            missing = sorted(acked - set(jobs))
            if missing:
                figures.lost_acknowledged += len(missing)
                figures.problems.append(f"round {rnd}: acknowledged but missing: {missing[:10]}")
            counts = collections.Counter(_read_ids(runs))
            twice = [j for j, n in counts.items() if n > 1]
            if twice:
                figures.ran_twice = len(twice)
                figures.problems.append(f"round {rnd}: jobs ran more than once: {twice[:10]}")
            for j, job in jobs.items():
                if j in checked_ok or job["state"] not in TERMINAL:
                    continue
                checked_ok.add(j)
                figures.jobs_by_state[job["state"]] += 1
                if j in victims:
                    # its process group killed: failed, "killed by signal 9"; its supervisor
                    # killed: lost, "supervisor killed ..." (or its own end, if the kill came
                    # after the supervisor recorded it)
                    story = _reason_of(daemon, j)
                    expected = {"job-group": ("failed", "signal 9"), "supervisor": ("lost", "supervisor")}[victims[j]]
                    ended_itself = job["state"] in ("succeeded", "failed") and job["exit_code"] == expected_exit(j)
                    if not ((job["state"], expected[1] in story) == (expected[0], True) or ended_itself):
                        figures.problems.append(
                            f"round {rnd}: job {j} whose {victims[j]} was killed ended {job['state']} "
                            f"(exit {job['exit_code']}); its story: {story[-300:]}")
                    continue
                if job["state"] in ("succeeded", "failed") and job["exit_code"] is not None:
                    if job["exit_code"] != expected_exit(j) or counts.get(j) != 1:
                        figures.wrong_exit += 1
                        figures.problems.append(
                            f"round {rnd}: job {j} {job['state']} exit {job['exit_code']} (expected "
                            f"{expected_exit(j)}), ran {counts.get(j, 0)} times")
                elif job["state"] == "lost" and not _reason_of(daemon, j):
                    figures.problems.append(f"round {rnd}: lost job {j} has no story")
            if rnd % model_every == 0 or rnd == rounds - 1:
                ok, said = log_verify(state)
                if not ok:
                    figures.verify_failures += 1
                    figures.problems.append(f"round {rnd}: log verify failed: {said[-300:]}")
                try:
                    diff = model_matches_rebuild(state)
                except Exception as exc:  # noqa: BLE001
                    diff = repr(exc)
                if diff:
                    figures.model_mismatches += 1
                    figures.problems.append(f"round {rnd}: read model differs from a rebuild: {diff[:300]}")
            figures.rounds = rnd + 1
            if log and (rnd + 1) % 10 == 0:
                log(f"round {rnd + 1}/{rounds}: {len(acked)} acknowledged, {len(checked_ok)} ended, "
                    f"{len(figures.problems)} problems, {time.monotonic() - t_start:.0f}s")
    finally:
        daemon.stop()
    figures.acknowledged = len(acked)
    figures.jobs_checked = len(checked_ok)
    figures.tracebacks = daemon.stderr().count("Traceback")
    if figures.tracebacks:
        figures.problems.append("the daemon printed a traceback: " + daemon.stderr()[daemon.stderr().index("Traceback"):][:600])
    figures.segments = len(list((state / "log").glob("*.seg")))
    figures.snapshots_on_disk = len(list((state / "snapshots").glob("*")))
    from eventsched.storage.log import last_seq

    figures.log_events = last_seq(state / "log")
    figures.seconds = round(time.monotonic() - t_start, 1)
    return figures


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--client":
        _client_main(sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5], int(sys.argv[6]))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--clients", type=int, default=3)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--model-every", type=int, default=1, help="compare the read model every N rounds")
    parser.add_argument("--keep", action="store_true", help="keep the state directory")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="es-soak-"))
    figures = run_soak(workdir, args.rounds, seed=args.seed, clients=args.clients, model_every=args.model_every)
    out = figures.as_dict()
    print(json.dumps(out, indent=1, default=dict))
    if not args.keep:
        import shutil

        shutil.rmtree(workdir, ignore_errors=True)
    else:
        print(f"state kept in {workdir}")
    return 1 if figures.problems else 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    raise SystemExit(main())
