"""The read model's tables and views, as DuckDB SQL (``docs/history-schema.md``).

Raw tables take the log's events and never change once written (a cheap bulk
insert); derived tables (``jobs``, ``placements``, ``gpus``) are recomputed for
what the newest events touched. Bump ``SCHEMA_VERSION`` on any change: the
read model is then rebuilt from the log.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from eventsched.domain.report_card import IDLE_PCT, SUGGEST_SQL
from eventsched.domain.states import DONE_FOR_GOOD, FINAL, STOP_OUTCOMES, TRANSITIONS, WAITING, JobState

SCHEMA_VERSION = 12


def _sql_set(items: Iterable[str]) -> str:
    return "(" + ", ".join(f"'{s}'" for s in sorted(items)) + ")"


def _state_sql() -> tuple[str, str]:
    """``states.TRANSITIONS`` as SQL: (the state each job event moves to, the legal
    ``state:type`` pairs). Each state-changing event type leads to one state (an
    exit: one rule), so the state before an event is the last target before it."""
    c, s, f = JobState.CANCELLED, JobState.SUCCEEDED, JobState.FAILED
    stops = "".join(f" WHEN stop = '{why}' THEN '{to}'" for why, to in STOP_OUTCOMES.items())
    # the core records the state an exit ends in; older logs fall back to exit_outcome's rule
    exited = (f"coalesce(nullif(outcome, ''), CASE WHEN reason = '{c}' THEN '{c}'{stops} "
              f"WHEN exit_code = 0 THEN '{s}' ELSE '{f}' END)")
    to = {"JobSubmitted": f"'{JobState.QUEUED}'"}  # a submission creates the job, queued
    legal = [":JobSubmitted"]
    for (state, event_type), target in TRANSITIONS.items():
        if target != state:
            sql = f"'{target}'" if isinstance(target, JobState) else exited
            if to.setdefault(event_type.__name__, sql) != sql:
                raise ValueError(f"{event_type.__name__} leads to several states: the read model cannot follow it")
            legal.append(f"{state}:{event_type.__name__}")
    return "CASE type " + " ".join(f"WHEN '{n}' THEN {sql}" for n, sql in to.items()) + " END", _sql_set(legal)


_TO_STATE, _LEGAL = _state_sql()
_FINAL, _WAITING, _EXITED = _sql_set(FINAL), _sql_set(WAITING), _sql_set(DONE_FOR_GOOD)
_EXIT_OUTCOMES = _sql_set(set(STOP_OUTCOMES.values()) | {JobState.SUCCEEDED, JobState.FAILED})


_RAW_DDL = """
CREATE TABLE IF NOT EXISTS _position (seq BIGINT NOT NULL, ts DOUBLE, schema_version INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS job_events (
    seq BIGINT, ts DOUBLE, job BIGINT, type VARCHAR, cause VARCHAR, detail VARCHAR,
    exit_code INTEGER, signal INTEGER, reason VARCHAR, outcome VARCHAR);
CREATE TABLE IF NOT EXISTS submissions (
    seq BIGINT, ts DOUBLE, job BIGINT, name VARCHAR, "user" VARCHAR, uid BIGINT, tenant VARCHAR,
    command VARCHAR, gpus DOUBLE, gpu_mem_mib BIGINT, allowed_gpu_ids VARCHAR, priority BIGINT,
    time_limit_s DOUBLE, on_time_limit VARCHAR, retries BIGINT, after VARCHAR, cwd VARCHAR,
    content_hash VARCHAR, node VARCHAR);
CREATE TABLE IF NOT EXISTS job_updates (
    seq BIGINT, ts DOUBLE, job BIGINT, "by" VARCHAR, priority BIGINT, time_limit_s DOUBLE, gpus DOUBLE,
    name VARCHAR);
CREATE TABLE IF NOT EXISTS placement_events (
    seq BIGINT, ts DOUBLE, job BIGINT, node VARCHAR, gpu INTEGER, idx INTEGER, share DOUBLE,
    gpu_mem_mib BIGINT, policy VARCHAR);
CREATE TABLE IF NOT EXISTS gpu_samples (
    seq BIGINT, ts DOUBLE, node VARCHAR, gpu INTEGER, utilization DOUBLE, memory_used_mib BIGINT,
    memory_total_mib BIGINT, temperature_c DOUBLE, power_w DOUBLE, foreign_memory_mib BIGINT);
CREATE TABLE IF NOT EXISTS job_gpu_memory (
    seq BIGINT, ts DOUBLE, node VARCHAR, gpu INTEGER, job BIGINT, memory_mib BIGINT);
CREATE TABLE IF NOT EXISTS gpu_events (
    seq BIGINT, ts DOUBLE, node VARCHAR, gpu INTEGER, type VARCHAR, cause VARCHAR, uuid VARCHAR,
    model VARCHAR, memory_total_mib BIGINT, "by" VARCHAR, error VARCHAR, lost BOOLEAN);
CREATE TABLE IF NOT EXISTS daemon_events (
    seq BIGINT, ts DOUBLE, type VARCHAR, cause VARCHAR, node VARCHAR, detail VARCHAR);
CREATE TABLE IF NOT EXISTS tenant_configs (
    seq BIGINT, ts DOUBLE, tenant VARCHAR, users VARCHAR, gpus DOUBLE, gpu_mem_mib BIGINT, jobs BIGINT,
    weight DOUBLE, preemptible BOOLEAN, "by" VARCHAR);
CREATE TABLE IF NOT EXISTS forecasts (
    seq BIGINT, ts DOUBLE, job BIGINT, estimated_start DOUBLE, "by" VARCHAR, p10 DOUBLE, p90 DOUBLE);
CREATE TABLE IF NOT EXISTS jobs (
    id BIGINT, name VARCHAR, "user" VARCHAR, uid BIGINT, tenant VARCHAR, command VARCHAR,
    gpus DOUBLE, gpu_mem_mib BIGINT, priority BIGINT, state VARCHAR,
    submitted_at DOUBLE, first_started_at DOUBLE, started_at DOUBLE, ended_at DOUBLE,
    wait_s DOUBLE, run_s DOUBLE, turnaround_s DOUBLE, exit_code INTEGER, signal INTEGER,
    reason VARCHAR, node VARCHAR, gpu_ids INTEGER[], attempts INTEGER, last_seq BIGINT);
CREATE TABLE IF NOT EXISTS placements (
    job BIGINT, seq BIGINT, node VARCHAR, gpu INTEGER, share DOUBLE, gpu_mem_mib BIGINT,
    from_ts DOUBLE, to_ts DOUBLE);
CREATE TABLE IF NOT EXISTS gpus (
    node VARCHAR, gpu INTEGER, uuid VARCHAR, model VARCHAR, memory_total_mib BIGINT,
    discovered_at DOUBLE, paused BOOLEAN, lost BOOLEAN, last_error VARCHAR);
"""

_VIEWS_DDL = f"""
CREATE OR REPLACE VIEW job_times AS
SELECT id, name, "user", tenant, gpus, state, submitted_at, started_at, ended_at,
       wait_s, run_s, turnaround_s, attempts
FROM jobs;

-- every placement with an end: open placements count up to the last event
CREATE OR REPLACE VIEW placement_spans AS
SELECT p.job, j."user", j.tenant, p.node, p.gpu, p.share, p.gpu_mem_mib, p.from_ts,
       coalesce(p.to_ts, greatest(p.from_ts, (SELECT max(ts) FROM _position))) AS to_ts,
       p.to_ts IS NULL AS open,
       p.share * (coalesce(p.to_ts, greatest(p.from_ts, (SELECT max(ts) FROM _position))) - p.from_ts)
           / 3600.0 AS gpu_hours
FROM placements p LEFT JOIN jobs j ON j.id = p.job;

CREATE OR REPLACE VIEW gpu_hours_by_user AS
SELECT "user", sum(gpu_hours) AS gpu_hours, count(DISTINCT job) AS jobs
FROM placement_spans GROUP BY "user";

CREATE OR REPLACE VIEW gpu_hours_by_tenant AS
SELECT tenant, sum(gpu_hours) AS gpu_hours, count(DISTINCT job) AS jobs
FROM placement_spans GROUP BY tenant;

-- GPU-hours per UTC day, a placement spanning midnight split between days
CREATE OR REPLACE VIEW gpu_hours_daily AS
WITH d AS (
    SELECT "user", tenant, share, from_ts, to_ts,
           unnest(range(floor(from_ts / 86400)::BIGINT, floor(to_ts / 86400)::BIGINT + 1)) AS day_no
    FROM placement_spans)
SELECT (DATE '1970-01-01' + day_no::INTEGER) AS day, "user", tenant,
       sum(share * greatest(0, least(to_ts, (day_no + 1) * 86400.0) - greatest(from_ts, day_no * 86400.0)))
           / 3600.0 AS gpu_hours
FROM d GROUP BY ALL;

CREATE OR REPLACE VIEW gpu_utilization AS
SELECT node, gpu, make_timestamp((floor(ts / 60) * 60 * 1e6)::BIGINT) AS minute,
       count(*) AS samples, avg(utilization) AS utilization_mean, max(utilization) AS utilization_peak,
       avg(memory_used_mib) AS memory_used_mib_mean, max(memory_used_mib) AS memory_used_mib_peak,
       max(temperature_c) AS temperature_c_peak, avg(power_w) AS power_w_mean
FROM gpu_samples GROUP BY ALL;

CREATE OR REPLACE VIEW gpu_utilization_summary AS
SELECT node, gpu, count(*) AS samples, avg(utilization) AS utilization_mean,
       max(utilization) AS utilization_peak, avg(memory_used_mib) AS memory_used_mib_mean,
       max(memory_used_mib) AS memory_used_mib_peak, max(temperature_c) AS temperature_c_peak,
       min(ts) AS first_ts, max(ts) AS last_ts
FROM gpu_samples GROUP BY ALL;

-- the tenants as last configured (quotas: NULL = no ceiling)
CREATE OR REPLACE VIEW tenant_quotas AS
SELECT tenant, users, gpus, gpu_mem_mib, jobs, weight, preemptible, ts AS configured_at, "by"
FROM tenant_configs WHERE seq = (SELECT max(seq) FROM tenant_configs);

-- every preemption: the victim, the waiting job it made room for, the rule
CREATE OR REPLACE VIEW preemptions AS
SELECT seq, ts, job AS victim,
       CAST(regexp_extract(detail, 'for_job=([0-9]+)', 1) AS BIGINT) AS for_job,
       regexp_extract(detail, 'rule=([a-z-]+)', 1) AS rule
FROM job_events WHERE type = 'JobCancelRequested' AND reason = 'preempted';

-- per tenant: its quota and weight now, GPU-hours used, jobs, waits, preemptions
CREATE OR REPLACE VIEW tenant_usage AS
WITH t AS (
    SELECT tenant FROM tenant_quotas UNION SELECT DISTINCT tenant FROM jobs WHERE tenant IS NOT NULL),
h AS (SELECT tenant, sum(gpu_hours) AS gpu_hours, sum(CASE WHEN open THEN share ELSE 0 END) AS gpus_now
      FROM placement_spans GROUP BY tenant),
j AS (SELECT tenant, count(*) AS jobs, avg(wait_s) AS mean_wait_s,
             count(*) FILTER (WHERE state IN {_WAITING}) AS waiting,
             count(*) FILTER (WHERE state = 'running') AS running
      FROM jobs GROUP BY tenant),
p AS (SELECT j.tenant, count(*) AS preemptions FROM preemptions x JOIN jobs j ON j.id = x.victim GROUP BY j.tenant)
SELECT t.tenant, q.gpus AS quota_gpus, q.gpu_mem_mib AS quota_gpu_mem_mib, q.jobs AS quota_jobs,
       coalesce(q.weight, 1.0) AS weight, coalesce(h.gpu_hours, 0) AS gpu_hours,
       coalesce(h.gpu_hours, 0) / nullif(sum(coalesce(h.gpu_hours, 0)) OVER (), 0) AS gpu_hours_share,
       coalesce(h.gpus_now, 0) AS gpus_now, coalesce(j.jobs, 0) AS jobs, coalesce(j.running, 0) AS running,
       coalesce(j.waiting, 0) AS waiting, j.mean_wait_s, coalesce(p.preemptions, 0) AS preempted
FROM t LEFT JOIN tenant_quotas q USING (tenant) LEFT JOIN h USING (tenant) LEFT JOIN j USING (tenant)
LEFT JOIN p USING (tenant);

-- each start forecast shown (explain) against the job's real first start
CREATE OR REPLACE VIEW forecast_errors AS
SELECT f.job, f.ts AS made_at, f.estimated_start, j.first_started_at AS started_at,
       j.first_started_at - f.estimated_start AS error_s,
       abs(j.first_started_at - f.estimated_start) AS abs_error_s,
       f.estimated_start - f.ts AS forecast_wait_s, j.first_started_at - f.ts AS actual_wait_s,
       j.first_started_at BETWEEN f.p10 AND f.p90 AS covered, f.p90 - f.p10 AS width_s
FROM forecasts f JOIN jobs j ON j.id = f.job
WHERE j.first_started_at IS NOT NULL;

-- each spell a running job held GPUs while idle (JobIdle's since to
-- JobBusy or its end; an open spell runs to the newest event folded), in GPU-hours
CREATE OR REPLACE VIEW idle_spans AS
WITH m AS (
    SELECT job, seq, ts, type, detail,
           lead(ts) OVER (PARTITION BY job ORDER BY seq) AS end_ts
    FROM job_events WHERE type IN ('JobIdle', 'JobBusy', 'JobExited', 'JobLost'))
SELECT m.job, j."user", j.tenant, j.gpus,
       CAST(regexp_extract(m.detail, 'since=([-0-9.e+]+)', 1) AS DOUBLE) AS since, m.ts AS flagged_at,
       m.end_ts AS ended_at, m.end_ts IS NULL AS open,
       greatest(0, coalesce(m.end_ts, (SELECT ts FROM _position))
                   - CAST(regexp_extract(m.detail, 'since=([-0-9.e+]+)', 1) AS DOUBLE)) * j.gpus / 3600.0
           AS idle_gpu_hours
FROM m JOIN jobs j ON j.id = m.job
WHERE m.type = 'JobIdle';

CREATE OR REPLACE VIEW idle_gpu_hours AS
SELECT "user" AS user_name, sum(idle_gpu_hours) AS idle_gpu_hours, count(*) AS spells,
       count(DISTINCT job) AS jobs
FROM idle_spans GROUP BY "user";

-- every time a job's processes held more GPU memory than its --gpu-mem
CREATE OR REPLACE VIEW gpu_memory_overruns AS
SELECT e.seq, e.ts, e.job, j."user",
       CAST(regexp_extract(e.detail, 'gpu=([0-9]+)', 1) AS INTEGER) AS gpu,
       CAST(regexp_extract(e.detail, 'used_mib=([0-9]+)', 1) AS BIGINT) AS used_mib,
       CAST(regexp_extract(e.detail, 'request_mib=([0-9]+)', 1) AS BIGINT) AS request_mib,
       regexp_extract(e.detail, 'policy=([a-z]+)', 1) AS policy
FROM job_events e JOIN jobs j ON j.id = e.job
WHERE e.type = 'JobGpuMemoryExceeded';

-- each job that ran, graded by its GPU samples: each sample of one of its GPUs
-- counts from its time to the GPU's next sample, within the job's placement there
CREATE OR REPLACE VIEW job_efficiency AS
WITH s AS (
    SELECT node, gpu, ts, utilization, lead(ts) OVER (PARTITION BY node, gpu ORDER BY seq) AS next_ts
    FROM gpu_samples),
seg AS (
    SELECT p.job, p.node, p.gpu, p.from_ts, p.share, s.utilization,
           least(coalesce(s.next_ts, p.to_ts), p.to_ts) - s.ts AS held_s
    FROM placement_spans p JOIN s ON s.node = p.node AND s.gpu = p.gpu AND s.ts >= p.from_ts AND s.ts < p.to_ts),
u AS (
    SELECT job, count(*) AS samples, sum(utilization * held_s) / nullif(sum(held_s), 0) AS utilization_mean,
           max(utilization) AS utilization_peak,
           coalesce(sum(held_s * share) FILTER (WHERE utilization <= {IDLE_PCT}), 0) / 3600.0 AS idle_gpu_hours
    FROM seg GROUP BY job),
-- the most GPUs busy at once, at most: the sum of its GPUs' peaks, in its busiest placement
g AS (
    SELECT job, max(busy) AS gpus_used_peak
    FROM (SELECT job, from_ts, sum(peak) AS busy
          FROM (SELECT job, from_ts, node, gpu, max(utilization) / 100.0 * max(share) AS peak
                FROM seg GROUP BY ALL) GROUP BY ALL)
    GROUP BY job),
h AS (SELECT job, sum(gpu_hours) AS gpu_hours FROM placement_spans GROUP BY job),
m AS (SELECT job, max(memory_mib) AS mem_peak_mib FROM job_gpu_memory GROUP BY job),
card AS (
    SELECT j.id AS job, j.name, j."user", j.tenant, j.state, j.gpus, j.gpu_mem_mib, j.first_started_at,
           j.ended_at, j.wait_s, j.run_s, coalesce(h.gpu_hours, 0) AS gpu_hours, coalesce(u.samples, 0) AS samples,
           u.utilization_mean, u.utilization_peak, g.gpus_used_peak, m.mem_peak_mib,
           NULL::BIGINT AS host_mem_peak_mib, coalesce(u.idle_gpu_hours, 0) AS idle_gpu_hours
    FROM jobs j LEFT JOIN h ON h.job = j.id LEFT JOIN u ON u.job = j.id LEFT JOIN g ON g.job = j.id
    LEFT JOIN m ON m.job = j.id
    WHERE j.first_started_at IS NOT NULL)
SELECT *, {SUGGEST_SQL[0]} AS suggested_gpus, {SUGGEST_SQL[1]} AS suggested_gpu_mem_mib FROM card;

CREATE OR REPLACE VIEW job_state_counts AS
SELECT state, count(*) AS jobs FROM jobs GROUP BY state;

CREATE OR REPLACE VIEW node_events AS
SELECT seq, ts, node, type, cause, detail FROM daemon_events
WHERE type IN ('NodeJoined', 'NodeLeft', 'NodeActorRestarted', 'ClusterDisconnected', 'StrayAttemptKilled',
               'NodeFenced');

CREATE OR REPLACE VIEW gpu_hours_by_node AS
SELECT node, count(DISTINCT job) AS jobs, sum(gpu_hours) AS gpu_hours FROM placement_spans GROUP BY node;
"""

TABLES = tuple(re.findall(r"CREATE TABLE IF NOT EXISTS (\w+)", _RAW_DDL))
VIEWS = tuple(re.findall(r"CREATE OR REPLACE VIEW (\w+)", _VIEWS_DDL))

# Jobs recomputed from the raw tables, for the ids in the registered `_touched`;
# each event moves the job by the transition table, or is ignored if it does not fit.
_JOBS_SQL = f"""
WITH ev AS (
    SELECT * FROM job_events WHERE job IN (SELECT job FROM _touched)
),
marks AS (
    SELECT *,
        -- why the job was asked to stop since it was last placed, if it was
        CASE WHEN max(CASE WHEN type = 'JobCancelRequested' THEN seq END) OVER w
                  > coalesce(max(CASE WHEN type = 'JobPlaced' THEN seq END) OVER w, 0)
             THEN last_value(CASE WHEN type = 'JobCancelRequested' THEN reason END IGNORE NULLS) OVER w END AS stop
    FROM ev
    WINDOW w AS (PARTITION BY job ORDER BY seq ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW)
),
moves AS (
    SELECT *, last_value(to_state IGNORE NULLS) OVER (
            PARTITION BY job ORDER BY seq ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING) AS prev
    FROM (SELECT *, {_TO_STATE} AS to_state FROM marks)
),
st AS (
    SELECT *, CASE WHEN concat(prev, ':', type) IN {_LEGAL} THEN to_state END AS state_after FROM moves
),
runs AS (
    -- one row per attempt: a JobStarted and the JobExited / JobLost that ended it
    SELECT job, sum(next_ts - ts) AS run_s
    FROM (
        SELECT job, type, ts,
               lead(ts) OVER (PARTITION BY job ORDER BY seq) AS next_ts,
               lead(type) OVER (PARTITION BY job ORDER BY seq) AS next_type
        FROM ev WHERE type IN ('JobStarted', 'JobExited', 'JobLost'))
    WHERE type = 'JobStarted' AND next_type IN ('JobExited', 'JobLost')
    GROUP BY job
),
agg AS (
    SELECT job,
        arg_max(state_after, seq) FILTER (WHERE state_after IS NOT NULL) AS state,
        max(ts) FILTER (WHERE state_after IS NOT NULL) AS state_ts,
        min(ts) FILTER (WHERE type = 'JobSubmitted') AS submitted_at,
        min(ts) FILTER (WHERE type = 'JobStarted') AS first_started_at,
        max(ts) FILTER (WHERE type = 'JobStarted') AS started_at,
        arg_max({{'code': exit_code, 'sig': signal, 'reason': reason}}, seq)
            FILTER (WHERE type = 'JobExited') AS last_exit,
        arg_max(reason, seq) FILTER (WHERE state_after IS NOT NULL) AS last_reason,
        count(*) FILTER (WHERE type = 'JobStarted') AS attempts,
        max(seq) AS last_seq
    FROM st GROUP BY job
),
upd AS (
    -- `update`: each field as last changed, if it was
    SELECT job, arg_max(name, seq) FILTER (WHERE name IS NOT NULL) AS name,
        arg_max(gpus, seq) FILTER (WHERE gpus IS NOT NULL) AS gpus,
        arg_max(priority, seq) FILTER (WHERE priority IS NOT NULL) AS priority
    FROM job_updates WHERE job IN (SELECT job FROM _touched) GROUP BY job
),
last_place AS (
    SELECT job, arg_max(node, seq) AS node, max(seq) AS seq
    FROM placement_events WHERE job IN (SELECT job FROM _touched) GROUP BY job
),
place_ids AS (
    SELECT p.job, list(p.gpu ORDER BY p.idx) AS gpu_ids
    FROM placement_events p JOIN last_place l ON p.job = l.job AND p.seq = l.seq
    GROUP BY p.job
)
SELECT a.job AS id, coalesce(u.name, s.name) AS name, s."user", s.uid, s.tenant, s.command,
    coalesce(u.gpus, s.gpus) AS gpus, s.gpu_mem_mib, coalesce(u.priority, s.priority) AS priority,
    a.state, a.submitted_at, a.first_started_at, a.started_at,
    CASE WHEN a.state IN {_FINAL} THEN a.state_ts END AS ended_at,
    a.first_started_at - a.submitted_at AS wait_s,
    r.run_s,
    CASE WHEN a.state IN {_FINAL} THEN a.state_ts - a.submitted_at END AS turnaround_s,
    CASE WHEN a.state IN {_EXITED} THEN a.last_exit.code END AS exit_code,
    CASE WHEN a.state IN {_EXITED} THEN a.last_exit.sig END AS signal,
    nullif(CASE WHEN a.state IN {_EXIT_OUTCOMES}
         THEN coalesce(nullif(a.last_exit.reason, ''), a.last_reason)
         ELSE a.last_reason END, '') AS reason,
    CASE WHEN a.state IN {_WAITING} THEN NULL ELSE l.node END AS node,
    CASE WHEN a.state IN {_WAITING} OR pi.gpu_ids IS NULL THEN []::INTEGER[] ELSE pi.gpu_ids END
        AS gpu_ids,
    a.attempts::INTEGER AS attempts, a.last_seq
FROM agg a
LEFT JOIN submissions s ON s.job = a.job
LEFT JOIN upd u ON u.job = a.job
LEFT JOIN runs r ON r.job = a.job
LEFT JOIN last_place l ON l.job = a.job
LEFT JOIN place_ids pi ON pi.job = a.job
"""

# A placement holds its GPU share from JobPlaced to the first event that ends
# the attempt (exit, cancel of a not-yet-started job, requeue, loss).
_PLACEMENTS_SQL = """
WITH ends AS (
    SELECT job, seq, ts FROM job_events
    WHERE job IN (SELECT job FROM _touched)
      AND type IN ('JobExited', 'JobCancelled', 'JobRequeued', 'JobLost')
),
p AS (SELECT * FROM placement_events WHERE job IN (SELECT job FROM _touched))
SELECT p.job, p.seq, p.node, p.gpu, p.share, p.gpu_mem_mib, p.ts AS from_ts, e.ts AS to_ts
FROM p ASOF LEFT JOIN ends e ON p.job = e.job AND p.seq < e.seq
"""

_GPUS_SQL = """
WITH g AS (SELECT * FROM gpu_events)
SELECT node, gpu,
    arg_max(uuid, seq) FILTER (WHERE type = 'GpuDiscovered') AS uuid,
    arg_max(model, seq) FILTER (WHERE type = 'GpuDiscovered') AS model,
    arg_max(memory_total_mib, seq) FILTER (WHERE type = 'GpuDiscovered') AS memory_total_mib,
    min(ts) FILTER (WHERE type = 'GpuDiscovered') AS discovered_at,
    coalesce(arg_max(type = 'GpuPaused', seq) FILTER (WHERE type IN ('GpuPaused', 'GpuResumed')), false)
        AS paused,
    coalesce(arg_max(lost AND type = 'GpuErrored', seq)
        FILTER (WHERE type = 'GpuDiscovered' OR (type = 'GpuErrored' AND lost)), false) AS lost,
    arg_max(error, seq) FILTER (WHERE type = 'GpuErrored') AS last_error
FROM g WHERE gpu >= 0 GROUP BY node, gpu
"""
