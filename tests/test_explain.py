"""Why a job waits: each reason from a real core state, asserted exactly."""

from __future__ import annotations

from eventsched import core
from eventsched.core.explain import waiting_reason, waiting_reasons
from eventsched.domain import events as ev
from eventsched.domain import messages as m
from eventsched.projections.cluster import ClusterState

NOW = 100.0


class Cluster:
    def __init__(self, gpus: int = 2, **config: object) -> None:
        self.state = ClusterState()
        infos = [m.GpuInfo(gpu=i, uuid=f"G{i}", model="fake", memory_total_mib=16000) for i in range(gpus)]
        self.do(m.Started(node="local", pid=1, version="t", gpu_backend="fake", gpus=infos,
                          config=m.SchedulerConfig(**config)))  # type: ignore[arg-type]

    def do(self, msg: m.Message) -> list[ev.Event]:
        return core.handle(self.state, msg, NOW)[0]

    def submit(self, uid: int = 1000, **spec: object) -> int:
        spec.setdefault("command", ["train"])
        event = self.do(m.Submit(spec=ev.JobSpec(uid=uid, user=f"u{uid}", **spec)))[0]  # type: ignore[arg-type]
        return event.job  # type: ignore[attr-defined]

    def text(self, job: int) -> str:
        reason = waiting_reason(self.state, job, NOW)
        assert reason is not None
        return reason.text


def test_resources_names_the_need_the_largest_free_set_and_the_paused_gpu() -> None:
    c = Cluster(gpus=4)
    c.do(m.PauseGpu(node="local", gpu=3))
    c.submit(gpus=1)
    c.submit(gpus=1)
    big = c.submit(gpus=2)
    assert c.text(big) == (
        "resources: needs 2 whole GPUs; the largest free set is 1 whole GPU; GPU 3 is paused"
    )
    reason = waiting_reason(c.state, big, NOW)
    assert reason is not None and reason.kind == "resources" and reason.blocked_gpus == {"local:3": "is paused"}


def test_a_hot_gpu_is_named_with_its_threshold() -> None:
    c = Cluster(gpus=2, max_gpu_temperature_c=85.0)
    c.do(m.GpuObserved(node="local", gpu=1, utilization=0, memory_used_mib=0, memory_total_mib=16000,
                       temperature_c=91, power_w=100))
    c.submit(gpus=1)
    waiting = c.submit(gpus=1)
    assert c.text(waiting) == (
        "resources: needs 1 whole GPU; the largest free set is 0 whole GPUs; "
        "GPU 1 is over its temperature threshold (91 C > 85 C)"
    )


def test_priority_counts_the_jobs_ahead_and_names_the_first_under_fifo() -> None:
    c = Cluster(gpus=1, policy="fifo")
    c.submit(gpus=1)  # runs
    head = c.submit(gpus=1, uid=1001)  # waits for the GPU
    small = c.submit(gpus=0.5)  # would fit nowhere either: resources, 1 ahead
    assert c.text(head) == "resources: needs 1 whole GPU; the largest free set is 0 whole GPUs"
    assert c.text(small) == "resources: needs 0.5 of a GPU; the largest free share is 0; 1 job ahead of it"
    c.do(m.ProcessExited(job=1, exit_code=0))
    # the head now runs; nothing waits ahead of the small job and it fits nowhere
    assert c.state.jobs[head].state == "running"


def test_a_job_that_fits_behind_a_blocked_fifo_head_waits_for_priority() -> None:
    c = Cluster(gpus=2, policy="fifo")
    c.submit(gpus=1)  # runs on GPU 0
    head = c.submit(gpus=2, uid=1001)  # needs both: blocks the FIFO queue
    small = c.submit(gpus=0.5)  # would fit on GPU 1
    assert c.text(small) == f"priority: 1 job ahead of it under fifo (first: job {head}, priority 0, u1001)"


def test_dependency_held_and_queue_limit() -> None:
    c = Cluster(gpus=2, max_running=1)
    first = c.submit(gpus=0.5)
    after = c.submit(gpus=0.5, after=[first])
    held = c.submit(gpus=0.5)
    c.do(m.Hold(jobs=[held], uid=1000))
    limited = c.submit(gpus=0.5)
    reasons = waiting_reasons(c.state, NOW)
    assert {j: (r.kind, r.text) for j, r in reasons.items()} == {
        after: ("dependency", f"dependency: waits for job {first} (running) to succeed"),
        held: ("held", f"held: `eventsched release {held}` lets it run"),
        limited: ("queue limit", "queue limit: 1 job running, max_running = 1"),
    }
    assert waiting_reason(c.state, first, NOW) is None  # running: no waiting reason


def test_backoff_after_a_failed_attempt() -> None:
    c = Cluster(gpus=1, retry_backoff_s=30.0)
    job = c.submit(gpus=1, retries=2)
    c.do(m.ProcessExited(job=job, exit_code=1))
    assert c.text(job) == "backoff: retry 1 of 2 may start in 30s"
