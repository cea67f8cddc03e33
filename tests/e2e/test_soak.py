"""The soak's smoke run in the suite (``bench/soak.py --smoke``, the benchmark's own code).

Three tenants run one 2-node digits run per fault kind of the rotation on a real embedded
stack (Airflow on PostgreSQL, a pool of 4, so one run waits most of the time); the triggerer is killed with SIGKILL and the stack's supervisor starts it again;
every Airflow component is stopped and started again; retention sweeps every 30 s with
short bounds. Asserted, as far as a short run can show it: every run succeeded with a clean
run's weights, every fault kind of the rotation ran once and healed with bounded lost work,
every event happened, and retention's invariants held (no task log older than the last sweep's
cutoff, no more rotated parts than kept, the run history capped). The growth bounds of the
long soak (quarter means of RSS, fds, rows and disk) need its ten minutes: ``bench/soak.py
--minutes 10`` measures them, and docs/benchmarks/soak.md gives the figures.
"""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.e2e


def test_soak_smoke_heals_every_fault_kind_and_keeps_retentions_invariants(tmp_path, soak_bench):
    bench = soak_bench
    result = bench.soak(1, retention_every=30.0, smoke=True, log=print)
    (tmp_path / "soak.json").write_text(json.dumps(result, indent=1))  # kept for a failure's post-mortem
    runs = result["runs"]
    assert runs["failed"] == [], runs["per_run"]
    assert runs["weights_equal_clean"] == runs["succeeded"] == len(bench.FAULTS)
    healed = {r["fault"] for r in runs["per_run"] if r.get("state") == "success"}
    assert healed >= {f[0]["kind"] if f else None for f in bench.FAULTS}, runs["per_run"]
    interval = result["conf"]["checkpoint_interval"]
    for run in runs["per_run"]:  # a corrupt newest checkpoint costs the interval before it too
        assert (run.get("steps_lost") or 0) <= 2 * interval, run
    events = result["events"]
    assert [e["what"] for e in events].count("restart") == 1
    assert any(e["what"] == "supervisor restart" and "triggerer" in e["components"] for e in events), events
    sweeps = [e for e in events if e["what"] == "retention"]
    assert len(sweeps) >= 3 and all(e["exit_code"] == 0 for e in sweeps)
    logs = result["bounds"]["logs_mb"]
    assert logs["bounded"] is True, logs
    assert logs["task_logs_past_cutoff_s"] <= 1.0 and logs["rotated_parts_max"] <= 1
    assert bench.healthy(result)
