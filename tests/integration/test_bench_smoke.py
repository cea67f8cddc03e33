"""Benchmarks keep running: each one's ``--smoke`` mode (seconds, tiny sizes) runs here, so a
code change that breaks a benchmark fails the suite."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_throughput_smoke_measures_every_side(tmp_path):
    out = tmp_path / "throughput.json"
    subprocess.run(
        [sys.executable, str(REPO / "bench" / "throughput.py"), "--smoke", "--out", str(out)], check=True, timeout=600
    )
    case = json.loads(out.read_text())["cases"]["digits/ddp"]
    assert case["plain_median"] > 0 and case["worker_median"] > 0
    assert 0 < case["worker_ratio"] < 10


def test_program_overhead_smoke_measures_both_recoveries_and_the_raw_side(tmp_path):
    """The Hugging Face program's benchmark, without its DAG side (the same program runs
    through the DAG in tests/e2e/test_programs.py)."""
    out = tmp_path / "program_overhead.json"
    subprocess.run(
        [sys.executable, str(REPO / "bench" / "program_overhead.py"), "--smoke", "--no-dag", "--out", str(out)],
        check=True,
        timeout=900,
    )
    result = json.loads(out.read_text())
    assert result["recovery_raw_median_s"] > 0 and result["recovery_trainflow_median_s"] > 0
    assert result["raw"][0]["steps_per_s"] > 0 and result["raw"][0]["wall_s"] > 0


def test_scheduler_smoke_runs_both_policies_through_decide(tmp_path):
    out = tmp_path / "scheduler.json"
    subprocess.run([sys.executable, str(REPO / "bench" / "scheduler.py"), "--smoke", "--out", str(out)], check=True,
                   timeout=300)  # fmt: skip
    result = json.loads(out.read_text())
    assert result["jobs"] == 300 and result["fifo"]["utilization"] > 0 and result["backfill"]["utilization"] > 0
    assert set(result["goals"]) >= {"backfill_mean_jct_below_fifo", "simulation_under_10s"}
    assert out.with_suffix(".png").stat().st_size > 0


def test_recovery_smoke_times_both_launchers(tmp_path):
    out = tmp_path / "recovery.json"
    subprocess.run([sys.executable, str(REPO / "bench" / "recovery.py"), "--smoke", "--out", str(out)], check=True,
                   timeout=600)  # fmt: skip
    result = json.loads(out.read_text())
    assert result["torchrun_median_s"] > 0 and result["trainflow_median_s"] > 0
    assert result["trainflow_stages"][0] and result["torchrun_stages"][0]


def test_detection_smoke_detects_a_crash_on_both_sides_and_a_hang_with_the_watch(tmp_path):
    out = tmp_path / "detection.json"
    subprocess.run([sys.executable, str(REPO / "bench" / "detection.py"), "--smoke", "--out", str(out)], check=True,
                   timeout=600)  # fmt: skip
    result = json.loads(out.read_text())
    assert result["crash"]["torchrun_median_s"] > 0 and result["crash"]["trainflow_median_s"] > 0
    assert 0 < result["hang"]["trainflow_median_s"] < 10
