"""FGD fragmentation math and the static Figure 9(a) experiment on small cases."""

from __future__ import annotations

import random
import statistics
from pathlib import Path

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_traces import NODE_CSV, POD_CSV

from eventsched.core.fgd import (
    NodeFragments,
    TaskType,
    fgd_score,
    fragmentation,
    node_fragmentation,
    target_workload,
)
from eventsched.sim.frag_table import FragTable
from eventsched.sim.static_sim import (
    PAPER,
    POLICIES,
    GoLikeRand,
    format_table,
    result_dict,
    run_one,
    run_static,
)
from eventsched.sim.traces import AlibabaNode, AlibabaPod, load_alibaba


# --- fragmentation of one node ------------------------------------------------


def test_half_free_gpu_is_fully_fragmented_for_larger_tasks() -> None:
    assert fragmentation([500], [(1, 600, 1.0)]) == 500.0


def test_gpu_big_enough_for_the_task_is_not_fragmented() -> None:
    assert fragmentation([500], [(1, 400, 1.0)]) == 0.0
    # the 300 left on the other GPU is too small for a 400 task
    assert fragmentation([500, 300], [(1, 400, 1.0)]) == 300.0


def test_multi_gpu_task_that_cannot_fit_sees_everything_as_fragment() -> None:
    # one whole GPU free + 300: a 2-GPU task fits nowhere -> all 1300 fragmented;
    # a 0.5 task can use the whole GPU, only the 300 is a fragment
    wl = [(1, 500, 0.5), (2, 1000, 0.5)]
    assert fragmentation([1000, 300], wl) == pytest.approx(0.5 * 300 + 0.5 * 1300)
    assert fragmentation([1000, 1000], [(2, 1000, 1.0)]) == 0.0


def test_cpu_only_tasks_cannot_use_gpus() -> None:
    assert fragmentation([1000, 250], [(0, 0, 1.0)]) == 1250.0


def test_full_node_has_no_fragmentation() -> None:
    assert fragmentation([0, 0, 0, 0], [(1, 500, 0.7), (1, 1000, 0.3)]) == 0.0


def test_node_fragmentation_counts_cpu_shortage_as_full_fragmentation() -> None:
    types = [TaskType(cpu_milli=4000, num_gpu=1, gpu_milli=500, popularity=1.0)]
    assert node_fragmentation([1000, 200], 8000, "T4", types) == 200.0
    assert node_fragmentation([1000, 200], 3000, "T4", types) == 1200.0
    spec = [TaskType(cpu_milli=0, num_gpu=1, gpu_milli=500, spec=("V100",), popularity=1.0)]
    assert node_fragmentation([1000, 200], 8000, "T4", spec) == 1200.0


def test_vectorised_fragmentation_matches_reference() -> None:
    rnd = random.Random(7)
    models = ["A", "B"]
    types = [
        TaskType(cpu_milli=rnd.choice([0, 2000, 8000]), num_gpu=k, gpu_milli=g,
                 spec=rnd.choice([(), ("A",)]), popularity=0.1)
        for k, g in [(1, 250), (1, 500), (1, 810), (1, 1000), (2, 1000), (4, 1000), (0, 0)]
    ] + [TaskType(cpu_milli=100, num_gpu=1, gpu_milli=100, popularity=0.3)]
    table = FragTable(types, models)
    free = np.array([[rnd.choice([0, 100, 190, 500, 750, 1000]) for _ in range(8)] for _ in range(200)])
    free[:50, 4:] = 0  # 4-GPU nodes padded with absent GPUs
    cpu = np.array([rnd.randrange(0, 10000) for _ in range(200)])
    model = np.array([rnd.randrange(2) for _ in range(200)])
    got = table.frag(free, cpu, model)
    want = [node_fragmentation([int(x) for x in (f[:4] if i < 50 else f)], int(c), models[m], types)
            for i, (f, c, m) in enumerate(zip(free, cpu, model))]
    assert got == pytest.approx(want)


_shares = st.sampled_from([0, 1, 100, 125, 250, 499, 500, 750, 999, 1000])
_workloads = st.lists(
    st.tuples(st.integers(0, 4), st.sampled_from([0, 125, 250, 500, 750, 1000]),
              st.floats(0.001, 1.0, allow_nan=False)), min_size=1, max_size=7)


@settings(max_examples=300, deadline=None)
@given(free=st.lists(_shares, min_size=1, max_size=16), workload=_workloads, data=st.data())
def test_a_node_summed_up_per_type_scores_exactly_as_the_full_pass(
        free: list[int], workload: list[tuple[int, int, float]], data: st.DataObject) -> None:
    """The fgd policy scores placements with NodeFragments: every score, and
    so every decision, must be the very float fragmentation() gives."""
    frags = NodeFragments(free, workload)
    assert frags.value() == fragmentation(free, workload)
    milli = data.draw(st.sampled_from([1, 125, 250, 500, 1000]))
    room = [i for i, f in enumerate(free) if f >= milli]
    taken = data.draw(st.lists(st.sampled_from(room), unique=True, max_size=4)) if room else []
    after = list(free)
    for i in taken:
        after[i] -= milli
    assert frags.after([free[i] for i in taken], milli) == fragmentation(after, workload)


def test_fgd_score_prefers_placements_that_reduce_fragmentation() -> None:
    assert fgd_score(0.0) == 50
    assert fgd_score(-2000.0) > fgd_score(0.0) > fgd_score(500.0)
    assert 0 <= fgd_score(1e9) <= fgd_score(-1e9) <= 100


def test_target_workload_of_the_trace_matches_the_paper_artifact() -> None:
    pods, _ = load_alibaba(POD_CSV, NODE_CSV)
    types = target_workload((p.cpu_milli, p.num_gpu, p.gpu_milli, p.gpu_spec) for p in pods)
    assert len(types) == 35  # 35 of 91 shapes
    assert sum(t.popularity for t in types) == pytest.approx(1.0)
    counts = {(p.cpu_milli, p.num_gpu, p.gpu_milli) for p in pods}
    assert len(counts) == 91
    covered = sum(
        1 for p in pods
        if any((t.cpu_milli, t.num_gpu, t.gpu_milli) == (p.cpu_milli, p.num_gpu, p.gpu_milli) for t in types)
    )
    assert round(100 * covered / len(pods), 2) == 95.26


# --- the Go-shaped PRNG --------------------------------------------------------


def test_go_like_rand_is_deterministic_and_permutes() -> None:
    a, b = GoLikeRand(42), GoLikeRand(42)
    assert a.perm(100) == b.perm(100)
    assert sorted(GoLikeRand(1).perm(1000)) == list(range(1000))
    items = list(range(50))
    GoLikeRand(3).shuffle(items)
    assert sorted(items) == list(range(50)) and items != list(range(50))


# --- the static experiment -------------------------------------------------------


def _pod(name: str, k: int, g: int, cpu: int = 1000, mem: int = 1024) -> AlibabaPod:
    return AlibabaPod(name=name, cpu_milli=cpu, memory_mib=mem, num_gpu=k, gpu_milli=g)


def _node(name: str, gpus: int, cpu: int = 32000, mem: int = 65536) -> AlibabaNode:
    return AlibabaNode(name=name, cpu_milli=cpu, memory_mib=mem, gpus=gpus, model="T4")


def test_packing_policies_keep_a_whole_gpu_for_the_whole_gpu_pod() -> None:
    # two 1-GPU nodes, two half-GPU pods and one whole-GPU pod: exactly full.
    nodes = [_node("n0", 1), _node("n1", 1)]
    pods = [_pod("p0", 1, 500), _pod("p1", 1, 500), _pod("p2", 1, 1000)]
    for policy in ("best-fit", "fgd", "packing", "clustering"):
        for seed in range(10):
            r = run_one(pods, nodes, policy, seed, tune=1.0)
            assert r.failed == 0, (policy, seed)
            assert r.unallocated[100] == 0.0
    # random scatters the halves sometimes, and the whole-GPU pod then fails
    rnd = [run_one(pods, nodes, "random", seed, tune=1.0) for seed in range(20)]
    assert any(r.failed == 1 and r.unallocated[100] == 50.0 for r in rnd)


def test_memory_is_enforced() -> None:
    nodes = [_node("n0", 2, mem=1000)]
    pods = [_pod("p0", 1, 1000, mem=800), _pod("p1", 1, 1000, mem=800)]
    r = run_one(pods, nodes, "best-fit", 1, tune=1.0)
    assert r.failed == 1 and r.unallocated[100] == 50.0


def _subset() -> tuple[list[AlibabaPod], list[AlibabaNode]]:
    pods, nodes = load_alibaba(POD_CSV, NODE_CSV)
    return pods[::8], nodes[::8]  # ~1,000 pods on ~150 nodes, demand ~ capacity


def test_static_run_is_deterministic_per_seed() -> None:
    pods, nodes = _subset()
    for policy in ("random", "fgd"):
        a = run_one(pods, nodes, policy, 42)
        b = run_one(list(reversed(pods)), nodes, policy, 42)  # input order does not matter
        assert a == b
    assert run_one(pods, nodes, "random", 42) != run_one(pods, nodes, "random", 43)


def test_fragmentation_aware_policies_beat_random_on_a_subset() -> None:
    pods, nodes = _subset()
    med = {
        pol: statistics.median(run_one(pods, nodes, pol, s).unallocated[100] for s in range(3))
        for pol in ("random", "best-fit", "fgd")
    }
    assert med["fgd"] <= med["random"]
    assert med["best-fit"] <= med["random"]
    assert all(0.0 <= v <= 100.0 for v in med.values())


def test_run_static_result_table_and_json(tmp_path: Path) -> None:
    pods, nodes = _subset()
    pod_csv, node_csv = tmp_path / "pods.csv", tmp_path / "nodes.csv"
    pod_csv.write_text("name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec\n" + "".join(
        f"{p.name},{p.cpu_milli},{p.memory_mib},{p.num_gpu},{p.gpu_milli},\n" for p in pods))
    node_csv.write_text("sn,cpu_milli,memory_mib,gpu,model\n" + "".join(
        f"{n.name},{n.cpu_milli},{n.memory_mib},{n.gpus},{n.model}\n" for n in nodes))
    res = run_static(str(pod_csv), str(node_csv), ["best-fit", "fgd"], [1, 2])
    assert [p.policy for p in res.policies] == ["best-fit", "fgd"]
    assert all(len(p.runs) == 2 and 100 in p.median for p in res.policies)
    table = format_table(res)
    assert "best-fit" in table and "7.09" in table and "4.77" in table
    d = result_dict(res)
    assert msgspec.json.decode(msgspec.json.encode(d))["policies"][1]["policy"] == "fgd"
    assert d["policies"][0]["paper"]["100"] == PAPER["best-fit"][100]
    with pytest.raises(ValueError, match="unknown policy"):
        run_static(str(pod_csv), str(node_csv), ["nope"], [1])


def test_all_paper_policies_are_implemented() -> None:
    assert set(PAPER) <= set(POLICIES)
