"""Benchmarks keep running: the ``--smoke`` mode of goodput (node agents on this machine), and of
preemption and concurrency (each on its own embedded Airflow stack), so a code change that
breaks one of them fails the suite. The figures of a smoke are not measurements: the tests
check that every side of each comparison ran and measured something."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _smoke(name: str, out: Path, timeout: float) -> dict:
    subprocess.run([sys.executable, str(REPO / "bench" / f"{name}.py"), "--smoke", "--out", str(out)], check=True,
                   timeout=timeout)  # fmt: skip
    return json.loads(out.read_text())


@pytest.mark.long_smoke
def test_goodput_smoke_faults_trainflow_checks_the_control_and_runs_the_plain_retry(tmp_path):
    result = _smoke("goodput", tmp_path / "goodput.json", timeout=900)
    assert result["clean_steps_per_s"] > 0 and result["spec"]["steps"] > 0
    clean = result["clean_run"]
    assert clean["completed"] and 0.5 < clean["goodput_clock_local_rate"] < 1.5
    trainflow = result["trainflow"]
    assert trainflow["completed"] and trainflow["faults"] == 1, trainflow
    assert 0 < trainflow["goodput_timeline"] <= 1 and 0 < trainflow["goodput_clock_local_rate"] < 1.5
    assert trainflow["recovery_s"] > 0 and len(trainflow["per_fault"]) == 1
    assert trainflow["per_fault"][0]["recovery_s"] > 0
    baseline = result["plain_retries"]
    assert len(baseline["attempts"]) == 1 and baseline["attempts"][0]["wall_s"] > 0
    assert not baseline["completed"] and baseline["goodput"] == 0.0


@pytest.mark.e2e
@pytest.mark.long_smoke
def test_preemption_smoke_times_the_priority_run_both_ways_and_the_preempted_runs_costs(tmp_path):
    result = _smoke("preemption", tmp_path / "preemption.json", timeout=900)
    assert result["rounds"] == 1
    assert result["priority_wait_no_preemption_median_s"] > 0 and result["priority_wait_with_preemption_median_s"] > 0
    (run,) = result["preempted_runs"]
    assert run["low_weights_equal_clean"]
    assert run["order_to_stop_s"] >= 0 and run["stop_to_nodes_back_s"] >= 0 and run["queue_wait_s"] >= 0
    assert run["readmitted_to_training_s"] > 0
    assert result["arrive_after_step"] < run["stopped_at_step"] < result["low"]["steps"]
    assert 0 <= run["steps_redone"] <= result["low"]["checkpoint_interval"]


@pytest.mark.e2e
@pytest.mark.long_smoke
def test_concurrency_smoke_completes_every_run_first_come_first_served_and_with_fair_share(tmp_path, postgres):
    result = _smoke("concurrency", tmp_path / "concurrency.json", timeout=900)
    for mode in ("fifo", "fairshare"):
        wave = result[mode]
        assert wave["failed"] == [] and wave["wall_s"] > 0, wave
        for tenant, runs in result["tenants"].items():
            figures = wave["per_tenant"][tenant]
            assert figures["completed"] == runs, (mode, tenant, figures)
            assert 0 < figures["p50_s"] <= figures["p95_s"] and len(figures["waits_s"]) == runs
        assert 0 < wave["all"]["p50_s"] <= wave["all"]["p95_s"]
