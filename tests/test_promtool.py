"""The Prometheus exposition passes `promtool check metrics`.

promtool comes from Debian's ``prometheus`` package (scripts/test.sh installs
it); its linter checks names and units (counters end in ``_total``, base units
such as seconds and bytes). Both what ``eventsched metrics --prometheus``
prints and what ``serve --metrics-port`` answers are checked.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import urllib.request
from pathlib import Path

import pytest
from daemon_harness import Daemon
from test_history import parse_prometheus, scenario_part1, scenario_part2, t, write

from eventsched.domain import events as ev
from eventsched.domain.tenants import Tenant
from eventsched.projections.history import History
from eventsched.projections.metrics import compute_metrics, prometheus_text
from eventsched.runtime.api.metrics_http import live_gauges

PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool is not installed (Debian package 'prometheus'; scripts/test.sh installs it)")


def promtool_findings(text: str) -> tuple[int, str]:
    """promtool's exit status and its findings (empty when the text is clean)."""
    assert PROMTOOL is not None
    r = subprocess.run([PROMTOOL, "check", "metrics"], input=text, capture_output=True, text=True, timeout=30)
    return r.returncode, (r.stdout + r.stderr).strip()


@needs_promtool
def test_promtool_flags_what_it_should() -> None:
    """The check is real: the names of the old exposition are findings."""
    rc, out = promtool_findings("# HELP x_gpu_hours_total h\n# TYPE x_gpu_hours_total counter\nx_gpu_hours_total 1\n"
                                "# HELP x_seq s\n# TYPE x_seq counter\nx_seq 3\n")
    assert rc != 0 and 'use base unit "seconds"' in out and '"_total" suffix' in out


@needs_promtool
def test_metrics_and_live_gauges_pass_promtool(tmp_path: Path) -> None:
    quota = Tenant(users=["alice", "carol"], gpus=2.0, gpu_mem_mib=8000, jobs=3, weight=2.0)
    write(tmp_path, scenario_part1() + scenario_part2()
          + [[ev.TenantsConfigured(ts=t(90_000), tenants={"ml": quota}, by="root")]])
    m = compute_metrics(History(tmp_path))
    text = prometheus_text(m)
    live = live_gauges({"jobs": [{"state": "running"}], "gpus": [{"node": "local", "id": 0, "allocated": 0.5}],
                        "seq": m["log_seq"]})
    rc, out = promtool_findings(live + text)
    assert (rc, out) == (0, "")
    samples = parse_prometheus(text)
    hours = {r["user"]: r["gpu_hours"] for r in m["gpu_hours_by_user"]}
    assert samples[("eventsched_user_gpu_seconds_total", (("user", "alice"),))] == pytest.approx(hours["alice"] * 3600)
    assert samples[("eventsched_tenant_quota_gpu_memory_bytes", (("tenant", "ml"),))] == 8000 * 2**20
    assert samples[("eventsched_tenant_quota_gpus", (("tenant", "ml"),))] == 2
    assert ("eventsched_tenant_gpu_time_share_ratio", (("tenant", "ml"),)) in samples
    assert "# TYPE eventsched_log_seq gauge" in live
    assert not re.search(r"gpu_hours", text + live)


@pytest.mark.slow
@needs_promtool
def test_a_real_daemons_scrape_and_cli_pass_promtool(tmp_path: Path) -> None:
    from test_e2e_history import free_port

    conf = tmp_path / "eventsched.toml"
    conf.write_text('[tenants.vision]\nusers = ["root"]\ngpus = 2\ngpu_mem_mib = 4096\n')
    port = free_port()
    with Daemon(tmp_path / "state", gpus="fake:2:16384",
                extra=["--config", str(conf), "--metrics-port", str(port)]) as d:
        ids = [d.submit("--gpus", "0.5", "--", "/bin/sleep", "0.3") for _ in range(3)]
        d.wait_states(ids, {"succeeded"}, timeout=30)
        cli = d.cli("metrics", "--prometheus")
        assert cli.returncode == 0, cli.stderr
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as response:
            scraped = response.read().decode()
    for text in (cli.stdout, scraped):
        assert promtool_findings(text) == (0, "")
        samples = parse_prometheus(text)
        assert samples[("eventsched_user_gpu_seconds_total", (("user", "root"),))] > 0
        assert samples[("eventsched_tenant_quota_gpus", (("tenant", "vision"),))] == 2
    assert "# TYPE eventsched_log_seq gauge" in scraped
    live = parse_prometheus(scraped)  # the live fair share of the only tenant: all of it
    assert live[("eventsched_tenant_fair_share_ratio", (("tenant", "vision"),))] == 1.0
    assert ("eventsched_tenant_fair_share_factor", (("tenant", "vision"),)) in live
