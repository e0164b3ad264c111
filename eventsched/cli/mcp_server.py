"""``eventsched mcp``: the CLI's commands as tools of an MCP server on stdio.

Each tool runs the very command a user would type, in this process, and hands
back what it printed (a failure: a tool error with its one-line reason). The
daemon sees this process's peer credentials, so the agent has exactly the
rights of the user who started the server (docs/mcp.md).
"""

from __future__ import annotations

import argparse
import io
import os
import sys
import threading
from contextlib import redirect_stderr, redirect_stdout

from eventsched.cli.errors import fail

TYPE_CHECKING = False
if TYPE_CHECKING:
    from mcp.server.mcpserver import MCPServer

__all__ = ["build_server", "run"]

ERROR_PREFIX = "eventsched: error: "
# one command at a time: each swaps the process's stdout, stderr and working directory
_ONE_AT_A_TIME = threading.Lock()


def run(args: argparse.Namespace) -> int:
    try:
        server = build_server(connection(args))
    except ModuleNotFoundError as exc:
        if not (exc.name or "").startswith("mcp"):
            raise
        fail("`eventsched mcp` needs the MCP SDK: pip install 'eventsched[mcp]' (or 'mcp>=2.3')", code=1)
    server.run("stdio")
    return 0


def connection(args: argparse.Namespace) -> list[str]:
    """``mcp``'s own --state-dir/--socket, passed on to every command."""
    return [*(["--state-dir", args.state_dir] if args.state_dir else []),
            *(["--socket", args.socket] if args.socket else [])]


def cli(argv: list[str], cwd: str | None = None) -> str:
    """What ``eventsched ARGV`` prints; its error lines raised as a ToolError."""
    from mcp.server.mcpserver.exceptions import ToolError

    from eventsched.cli import main

    out = io.TextIOWrapper(io.BytesIO(), encoding="utf-8", errors="replace", write_through=True)
    err = io.StringIO()
    with _ONE_AT_A_TIME, redirect_stdout(out), redirect_stderr(err):
        before = os.getcwd()
        try:
            if cwd:
                os.chdir(cwd)
            code = main(argv)
        except SystemExit as exc:  # a usage error or refusal, said on stderr
            code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
        except OSError as exc:
            code = 1
            print(f"{ERROR_PREFIX}{exc}", file=sys.stderr)
        finally:
            os.chdir(before)
    printed = out.buffer.getvalue().decode("utf-8", "replace")  # type: ignore[attr-defined]  # a BytesIO
    if code:
        said = err.getvalue().replace(ERROR_PREFIX, "")
        raise ToolError((printed + said).strip() or f"exit status {code}")
    return printed


def build_server(common: list[str]) -> MCPServer:
    """The tools, each one CLI command (raises ImportError without the SDK)."""
    from mcp.server.mcpserver import MCPServer
    from mcp.types import ToolAnnotations

    # warnings only: the client logs our stderr, and a line logged while a command runs would be captured with it
    server = MCPServer("eventsched", log_level="WARNING",
                       instructions="The GPU job scheduler of this machine, acting as the user who runs this server. "
                                    "`explain` says why a job waits.")
    read_only = ToolAnnotations(read_only_hint=True)

    def json_flag(as_json: bool) -> list[str]:
        return ["--json"] if as_json else []

    @server.tool(structured_output=False)
    def submit(command: list[str], gpus: float | None = None, gpu_mem_mib: int | None = None,
               gpu_ids: str | None = None, name: str | None = None, priority: int = 0,
               time_limit: str | None = None, tenant: str | None = None, after: list[int] | None = None,
               begin: str | None = None, cwd: str | None = None) -> str:
        """Submit a job (eventsched submit); returns its id. `command` is the argv (one string with blanks runs
        through the shell); gpus: a share of one GPU (0.1-1) or a whole number; time_limit: 90, 15m, 2h;
        after: run only after these jobs succeeded; begin: not before (+10m, 16:00); cwd: where it runs."""
        options = [("--gpus", gpus), ("--gpu-mem", gpu_mem_mib), ("--gpu-ids", gpu_ids), ("--name", name),
                   ("--priority", priority or None), ("--time-limit", time_limit), ("--tenant", tenant),
                   *(("--after", job) for job in after or ()), ("--begin", begin)]
        argv = [f"{flag}={value}" for flag, value in options if value is not None]  # a value may begin with "-"
        return cli(["submit", *common, *argv, "--", *command], cwd=cwd)

    @server.tool(annotations=read_only, structured_output=False)
    def queue(all: bool = False, json: bool = False) -> str:
        """Queued and running jobs (eventsched queue); all: finished ones too; REASON says why one waits."""
        return cli(["queue", *common, *(["--all"] if all else []), *json_flag(json)])

    @server.tool(annotations=read_only, structured_output=False)
    def explain(job: int, json: bool = False) -> str:
        """Why a job waits (what it waits for, its place, when it may start) and its story (eventsched explain)."""
        return cli(["explain", *common, str(job), *json_flag(json)])

    @server.tool(annotations=ToolAnnotations(destructive_hint=True), structured_output=False)
    def cancel(jobs: list[int | str]) -> str:
        """Cancel jobs: ids, an array's id, or ARRAY_INDEX like 12_3 (eventsched cancel); only your own."""
        return cli(["cancel", *common, *map(str, jobs)])

    @server.tool(annotations=read_only, structured_output=False)
    def logs(job: int, lines: int = 100) -> str:
        """The last `lines` lines of a job's output (eventsched logs)."""
        text = cli(["logs", *common, str(job)])
        return "".join(text.splitlines(keepends=True)[-max(lines, 1):])

    @server.tool(annotations=read_only, structured_output=False)
    def status(json: bool = False) -> str:
        """GPUs (allocation, utilisation, memory), and the counts of running and queued jobs (eventsched status)."""
        return cli(["status", *common, *json_flag(json)])

    @server.tool(annotations=read_only, structured_output=False)
    def sql(query: str, format: str = "table") -> str:
        """Read-only SQL (DuckDB) over the whole history (eventsched sql); format: table, csv or json.
        `SELECT table_name FROM information_schema.tables` lists the tables."""
        if format not in ("table", "csv", "json"):
            from mcp.server.mcpserver.exceptions import ToolError

            raise ToolError(f"format must be table, csv or json, not {format!r}")
        return cli(["sql", *common, query, "--format", format])

    @server.tool(annotations=read_only, structured_output=False)
    def report(since: str = "30d", by: str = "user", format: str = "table") -> str:
        """GPU-hours used and idle, efficiency, waits and jobs of the jobs started since (eventsched report);
        by: user, tenant or day; format: table, csv, json or markdown."""
        return cli(["report", *common, f"--since={since}", f"--by={by}", f"--format={format}"])

    return server
