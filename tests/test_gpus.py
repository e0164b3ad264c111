"""GPU backends: --gpus parsing, fake GPUs following load, NVML absent here, sample thinning."""

from __future__ import annotations

import pytest

from eventsched.domain.messages import GpuFailed, GpuObserved
from eventsched.runtime.gpus import (
    DEFAULT_FAKE_MEM_MIB,
    FakeBackend,
    GpuBackend,
    GpuSpecError,
    NvmlBackend,
    NvmlUnavailable,
    parse_gpus_option,
    significant,
)

# --- --gpus parsing ----------------------------------------------------------


def test_fake_spec_with_default_memory() -> None:
    b = parse_gpus_option("fake:4")
    assert isinstance(b, FakeBackend) and isinstance(b, GpuBackend)
    gpus = b.discover()
    assert [g.gpu for g in gpus] == [0, 1, 2, 3]
    assert {g.memory_total_mib for g in gpus} == {DEFAULT_FAKE_MEM_MIB}
    assert len({g.uuid for g in gpus}) == 4
    assert b.name == f"fake:4:{DEFAULT_FAKE_MEM_MIB}"


def test_fake_spec_with_memory_and_node() -> None:
    b = parse_gpus_option("fake:2:40960", node="n1")
    assert [g.memory_total_mib for g in b.discover()] == [40960, 40960]
    assert {s.node for s in b.sample()} == {"n1"}


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("fake:0", "at least 1"),
        ("fake:-1", "at least 1"),
        ("fake:x", "whole number"),
        ("fake:", "fake:N"),
        ("fake", "fake:N"),
        ("fake:2:0", "at least 1"),
        ("fake:2:lots", "whole number"),
        ("fake:2:10:3", "fake:N"),
        ("fake:1.5", "whole number"),
        ("cuda:2", "expected 'nvml' or 'fake"),
        ("fake:99999", "at most 1024"),
    ],
)
def test_bad_gpus_specs_get_one_clear_line(text: str, fragment: str) -> None:
    with pytest.raises(GpuSpecError) as info:
        parse_gpus_option(text)
    message = str(info.value)
    assert fragment in message and "\n" not in message
    assert repr(text) in message  # names what was wrong


# --- NVML on this machine (no driver): the real call, not mocked ---------------


def test_nvml_without_driver_says_how_to_use_fake_gpus() -> None:
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:
        pass
    else:  # pragma: no cover - only on a machine with a driver
        pynvml.nvmlShutdown()
        pytest.skip("this machine has an NVIDIA driver")
    for make in (lambda: NvmlBackend(), lambda: parse_gpus_option("nvml"), lambda: parse_gpus_option("")):
        with pytest.raises(NvmlUnavailable) as info:
            make()
        message = str(info.value)
        assert "--gpus fake:N" in message and "NVML" in message
        assert "\n" not in message


# --- fake samples follow the load ----------------------------------------------


def _by_gpu(samples: list) -> dict[int, GpuObserved]:
    return {s.gpu: s for s in samples if isinstance(s, GpuObserved)}


def test_idle_fake_gpus_are_cool_and_empty() -> None:
    b = FakeBackend(2, 1000)
    for s in b.sample():
        assert isinstance(s, GpuObserved)
        assert s.utilization == 0 and s.memory_used_mib == 0 and s.memory_total_mib == 1000
        assert s.foreign_memory_mib == 0


def test_fake_samples_follow_what_was_placed() -> None:
    b = FakeBackend(3, 81920)
    b.set_load(0, 0.5, 20000)
    b.set_load(1, 1.0, 70000)
    for _ in range(10):  # jitter stays small on every tick
        s = _by_gpu(b.sample())
        assert abs(s[0].utilization - 50) <= 2
        assert 98 <= s[1].utilization <= 100
        assert s[2].utilization == 0
        assert s[0].memory_used_mib == 20000 and s[1].memory_used_mib == 70000
        assert s[1].temperature_c > s[0].temperature_c > s[2].temperature_c
        assert s[1].power_w > s[0].power_w > s[2].power_w
    b.set_load(1, 0.0, 0)  # the job ended: the GPU goes quiet again
    s = _by_gpu(b.sample())
    assert s[1].utilization == 0 and s[1].memory_used_mib == 0


def test_fake_samples_are_deterministic() -> None:
    a, b = FakeBackend(2), FakeBackend(2)
    for x in (a, b):
        x.set_load(0, 0.3, 100)
    assert [a.sample() for _ in range(5)] == [b.sample() for _ in range(5)]


def test_foreign_memory_counts_in_used_and_is_reported() -> None:
    b = FakeBackend(1, 10000)
    b.set_load(0, 0.5, 3000)
    b.set_foreign(0, 4000)
    (s,) = b.sample()
    assert s.foreign_memory_mib == 4000 and s.memory_used_mib == 7000


def test_failed_fake_gpu_reports_gpu_failed_not_an_exception() -> None:
    b = FakeBackend(2)
    b.fail(1, "Xid 79", lost=True)
    samples = b.sample()
    assert isinstance(samples[0], GpuObserved)
    assert samples[1] == GpuFailed(node="local", gpu=1, error="Xid 79", lost=True)
    assert [g.gpu for g in b.discover()] == [0]  # a lost GPU is gone
    b.heal(1)
    assert all(isinstance(s, GpuObserved) for s in b.sample())


def test_hooks_reject_unknown_gpu() -> None:
    b = FakeBackend(2)
    with pytest.raises(IndexError):
        b.set_load(2, 0.5, 0)


# --- significant(): keeping the log lean --------------------------------------


def _obs(util: float = 50, mem: int = 10000, temp: float = 60, foreign: int = 0, total: int = 81920) -> GpuObserved:
    return GpuObserved(
        node="local",
        gpu=0,
        utilization=util,
        memory_used_mib=mem,
        memory_total_mib=total,
        temperature_c=temp,
        power_w=200,
        foreign_memory_mib=foreign,
    )


def test_first_sample_is_always_logged() -> None:
    assert significant(None, _obs(), last_ts=0, now=0)


@pytest.mark.parametrize(
    "new",
    [
        _obs(util=55),
        _obs(util=45),
        _obs(mem=10256),
        _obs(mem=9744),
        _obs(temp=63),
        _obs(temp=57),
        _obs(foreign=256),
    ],
)
def test_meaningful_changes_are_logged(new: GpuObserved) -> None:
    assert significant(_obs(), new, last_ts=100, now=101)


@pytest.mark.parametrize("new", [_obs(), _obs(util=54), _obs(mem=10255), _obs(temp=62.9), _obs(foreign=100)])
def test_small_changes_are_not_logged(new: GpuObserved) -> None:
    assert not significant(_obs(), new, last_ts=100, now=159.9)


def test_unchanged_sample_is_logged_once_a_minute() -> None:
    assert significant(_obs(), _obs(), last_ts=100, now=160)
    assert significant(_obs(), _obs(), last_ts=100, now=110, min_interval_s=10)


def test_two_percent_of_a_small_card_is_significant() -> None:
    # 2% of 4096 MiB is 82 MiB, below the 256 MiB step
    assert significant(_obs(mem=1000, total=4096), _obs(mem=1090, total=4096), last_ts=0, now=1)


def test_fake_jitter_alone_never_bloats_the_log() -> None:
    b = FakeBackend(1)
    b.set_load(0, 0.5, 1000)
    first = b.sample()[0]
    logged = 0
    for t in range(1, 59):
        if significant(first, b.sample()[0], last_ts=0, now=t):
            logged += 1
    assert logged == 0
