"""Trace importers: the Alibaba openb files and the plain job CSV."""

from __future__ import annotations

from pathlib import Path

import pytest

from eventsched.sim.traces import TraceError, TraceJob, load_alibaba, load_csv

TRACES = Path("/work/shared/traces")
POD_CSV = TRACES / "openb_pod_list_default.csv"
NODE_CSV = TRACES / "openb_node_list_gpu_node.csv"


def test_alibaba_trace_loads_with_documented_totals() -> None:
    pods, nodes = load_alibaba(POD_CSV, NODE_CSV)
    assert len(pods) == 8152 and len(nodes) == 1213
    assert sum(p.num_gpu * p.gpu_milli for p in pods) == 6_086_800
    assert sum(n.gpus for n in nodes) == 6212
    assert sum(n.cpu_milli for n in nodes) == 107_018_000
    p1 = pods[1]
    assert (p1.name, p1.cpu_milli, p1.memory_mib, p1.num_gpu, p1.gpu_milli) == (
        "openb-pod-0001", 6000, 12288, 1, 460)
    assert p1.gpu_spec == () and p1.pod_phase == "Running"
    assert sum(1 for p in pods if p.scheduled_time is None) == 897  # the Pending pods
    assert {n.model for n in nodes} >= {"G2", "T4", "P100", "V100M16"}


def test_alibaba_bad_row_names_file_and_line(tmp_path: Path) -> None:
    f = tmp_path / "pods.csv"
    f.write_text(
        "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec\n"
        "p0,1000,1024,1,500,\n"
        "p1,1000,1024,1,1500,\n"
    )
    with pytest.raises(TraceError, match=r"pods\.csv:3: gpu_milli must be in 0\.\.1000, got '1500'"):
        load_alibaba(f, NODE_CSV)
    g = tmp_path / "nodes.csv"
    g.write_text("sn,cpu_milli,memory_mib,model\nn0,1000,1024,T4\n")
    with pytest.raises(TraceError, match=r"nodes\.csv:1: header must name .*missing gpu"):
        load_alibaba(POD_CSV, g)


def _write(tmp_path: Path, text: str) -> Path:
    f = tmp_path / "jobs.csv"
    f.write_text(text)
    return f


def test_csv_with_all_columns(tmp_path: Path) -> None:
    f = _write(tmp_path, (
        "# my workload\n"
        "submit_time,duration,gpus,gpu_mem,user,priority\n"
        "0,3600,0.5,8000,alice,2\n"
        "\n"
        "10.5,60,2,,bob,\n"
        "11,1,0,0,,-1\n"
    ))
    assert load_csv(f) == [
        TraceJob(submit_time=0.0, duration=3600.0, gpus=0.5, gpu_mem_mib=8000, user="alice", priority=2),
        TraceJob(submit_time=10.5, duration=60.0, gpus=2.0, gpu_mem_mib=0, user="bob", priority=0),
        TraceJob(submit_time=11.0, duration=1.0, gpus=0.0, gpu_mem_mib=0, user="", priority=-1),
    ]


def test_csv_minimal_columns_in_any_order(tmp_path: Path) -> None:
    f = _write(tmp_path, "gpus,submit_time,duration\n1,5,10\n")
    assert load_csv(f) == [TraceJob(submit_time=5.0, duration=10.0, gpus=1.0)]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("submit_time,duration\n0,1\n", r"jobs\.csv:1: header must name submit_time, duration, gpus; missing gpus"),
        ("submit_time,duration,gpus\n0,1,1\nx,1,1\n", r"jobs\.csv:3: submit_time must be a number, got 'x'"),
        ("submit_time,duration,gpus\n0,-3,1\n", r"jobs\.csv:2: duration must be > 0, got '-3'"),
        ("submit_time,duration,gpus\n0,1,1.5\n", r"jobs\.csv:2: gpus must be 0, a share in \(0, 1\) or a whole"),
        ("submit_time,duration,gpus\n0,1,-1\n", r"jobs\.csv:2: gpus must be"),
        ("submit_time,duration,gpus\n0,1,nan\n", r"jobs\.csv:2: gpus must be finite"),
        ("submit_time,duration,gpus\n\n# c\n0,1\n", r"jobs\.csv:4: expected 3 fields, got 2"),
        ("submit_time,duration,gpus,gpu_mem\n0,1,1,lots\n", r"jobs\.csv:2: gpu_mem must be an integer, got 'lots'"),
        ("submit_time,duration,gpus,priority\n0,1,1,high\n", r"jobs\.csv:2: priority must be an integer, got 'high'"),
        ("", r"jobs\.csv: empty file \(a header line is required\)"),
    ],
)
def test_csv_errors_are_one_line_with_line_number(tmp_path: Path, text: str, message: str) -> None:
    f = _write(tmp_path, text)
    with pytest.raises(TraceError, match=message) as e:
        load_csv(f)
    assert "\n" not in str(e.value)


def test_missing_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match=r"nope\.csv: cannot read"):
        load_csv(tmp_path / "nope.csv")
