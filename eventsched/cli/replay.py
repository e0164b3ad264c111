"""``eventsched replay SOURCE --policy A [--policy B ...]``: run and compare
replays, each into a state dir of its own (``<out>/<policy>``); ``--static``:
the FGD paper's static packing experiment on the Alibaba trace instead."""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path
from typing import Any

from eventsched.domain.text import print_error, print_json

__all__ = ["run_replay", "replay_table", "parse_seeds"]


def _fail(message: str) -> int:
    print_error(message, command="replay")
    return 2


def parse_seeds(text: str) -> list[int]:
    """``42-51`` or ``1,2,7`` (or a mix) -> a list of seeds."""
    seeds: list[int] = []
    for part in text.split(","):
        lo, dash, hi = part.strip().partition("-")
        if not (lo.isdecimal() and (hi.isdecimal() or not dash)):
            raise ValueError(f"--seeds must look like 42-51 or 1,2,3, got {text!r}")
        if int(hi or lo) < int(lo):
            raise ValueError(f"bad seed range {part.strip()!r}")
        seeds.extend(range(int(lo), int(hi or lo) + 1))
    return seeds


def _run_static(args: argparse.Namespace) -> int:
    from eventsched.sim import static_sim
    from eventsched.sim.traces import TraceError

    try:
        seeds = parse_seeds(args.seeds)
    except ValueError as e:
        return _fail(str(e))
    pod_csv = Path(args.source)
    node_csv = pod_csv.parent / "openb_node_list_gpu_node.csv"
    if not pod_csv.is_file():
        return _fail(f"{pod_csv}: no such file (--static needs the Alibaba openb pod list)")
    if not node_csv.is_file():
        return _fail(f"{node_csv}: no such file (the node list must sit next to the pod list)")
    unknown = [p for p in args.policy if p not in static_sim.POLICIES]
    if unknown:
        return _fail(f"unknown policy {unknown[0]!r} for --static; choose from {', '.join(static_sim.POLICIES)}")
    try:
        result = static_sim.run_static(str(pod_csv), str(node_csv), list(args.policy), seeds)
    except (TraceError, ValueError) as e:
        return _fail(str(e).splitlines()[0] if str(e) else type(e).__name__)
    if args.json:
        print_json(static_sim.result_dict(result))
    else:
        print(static_sim.format_table(result))
    return 0


def what_if(path: str) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The ``[scheduler]`` keys and ``[tenants]`` a config file sets, to replay
    under them; keys it does not set stay as recorded."""
    import tomllib

    import msgspec

    from eventsched.runtime.config import ConfigError, load_config, plain_tenants

    try:
        config = load_config(path)
        raw = tomllib.loads(Path(path).read_text()) if not path.endswith(".json") else {}
    except (ConfigError, OSError, tomllib.TOMLDecodeError) as e:
        raise ValueError(str(e)) from None
    given = set((raw.get("scheduler") or {}).keys())
    settings = {k: v for k, v in msgspec.to_builtins(config.scheduler).items() if k in given}
    if raw.get("policy") or config.policy:
        settings.pop("policy", None)  # --policy chooses the policies here
    return settings, (plain_tenants(config) if config.tenants else None)


def replay_table(source: str, policies: list[str], *, config: str | None = None, gpus: str | None = None,
                 nodes: int = 1, out: str | None = None) -> dict[str, Any]:
    """Replay ``source`` under each policy and compare (``compare``'s table);
    the one path of ``eventsched replay`` and the notebook's what-if. A source,
    policy or config that cannot be replayed raises ``ValueError``, one line."""
    from eventsched.core.policies import POLICIES
    from eventsched.sim.simulator import RECORDED, simulate
    from eventsched.sim.sources import ReplayError, load_source
    from eventsched.storage.log import LogError
    from eventsched.sim.whatif import compare

    policies = list(dict.fromkeys(policies))
    for p in policies:
        if p != RECORDED and p not in POLICIES:
            raise ValueError(f"unknown policy {p!r}; choose from {', '.join(POLICIES)} (or {RECORDED})")
    try:
        workload = load_source(source, gpus=gpus, nodes=nodes)
    except ReplayError as e:
        raise ValueError(str(e)) from None
    if RECORDED in policies and workload.kind != "log":
        raise ValueError(f"policy {RECORDED!r} needs a recorded log as the source")
    settings: dict[str, Any] = {}
    tenants: dict[str, Any] | None = None
    if config:
        settings, tenants = what_if(config)
        if RECORDED in policies and (settings or tenants is not None):
            raise ValueError(f"--config changes what {RECORDED!r} would replay as it was; leave one of them out")
    if out:
        for p in policies:
            target = Path(out) / p / "log"
            try:
                held = target.is_dir() and any(target.iterdir())
            except OSError as e:  # a name too long, a folder it may not read
                raise ValueError(f"--out {out}: {e.strerror or e}") from None
            if held:
                raise ValueError(f"{target} already holds a log; choose another --out")
    where = Path(out) if out else Path(tempfile.mkdtemp(prefix="eventsched-replay-"))
    try:
        results = [simulate(workload, p, where / p, settings=settings, tenants=tenants) for p in policies]
        table = compare(results, baseline=("as recorded", workload.name) if workload.kind == "log" else None)
    except (ReplayError, LogError) as e:  # a log that cannot be made under --out says so in one line
        raise ValueError(str(e)) from None
    except OSError as e:
        raise ValueError(f"cannot write the replay logs under {where}: {e.strerror or e}") from None
    finally:
        if not out:  # scratch: kept only where --out asks
            shutil.rmtree(where, ignore_errors=True)
    table["out"] = out
    return table


def run_replay(args: argparse.Namespace) -> int:
    """Replay ``args.source`` under each ``args.policy``; print the comparison."""
    if args.static:
        return _run_static(args)
    from eventsched.sim.whatif import format_comparison

    try:
        table = replay_table(args.source, args.policy or [], config=args.config, gpus=args.gpus,
                             nodes=args.nodes or 1, out=args.out)
    except ValueError as e:
        return _fail(str(e))
    if args.json:
        print_json(table)
    else:
        out = args.out
        print(format_comparison(table))
        print(f"replay logs: {out}/<policy> (eventsched sql --state-dir {out}/<policy> ...)" if out
              else "replay logs: not kept (--out DIR keeps them)")
    return 0
