"""Benchmarks of checkpoint I/O and of the DAG's overhead keep running: each one's ``--smoke``
mode (tiny sizes, every side of its comparison) runs here, so a code change that breaks a
benchmark fails the suite. The figures are checked for presence and sanity, not for goals."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def smoke(name: str, out: Path, timeout: float) -> dict:
    subprocess.run(
        [sys.executable, str(REPO / "bench" / f"{name}.py"), "--smoke", "--out", str(out)], check=True, timeout=timeout
    )
    return json.loads(out.read_text())


def test_checkpoint_smoke_measures_every_stall_and_throughput(tmp_path):
    result = smoke("checkpoint", tmp_path / "checkpoint.json", 300)
    assert result["state_bytes"] > 1_000_000 and result["world_size"] == 2
    for series in ("sync_stall_s", "async_stall_s", "raw_write_s", "raw_direct_write_s", "load_s", "raw_read_s"):
        assert result[series] and all(t > 0 for t in result[series]), series
    for rate in ("save_throughput_MBps", "raw_write_MBps", "raw_direct_write_MBps", "load_throughput_MBps"):
        assert result[rate] > 0, rate
    assert result["raw_read_MBps"] > 0 and result["verify_MBps"] > 0
    assert result["stall_ratio_async_over_sync"] > 0 and result["stage_copy_floor_over_sync"] > 0
    assert result["save_vs_raw"] > 0 and result["load_vs_raw"] > 0
    assert all(t > 0 for t in result["block_no_save_s"] + result["block_with_save_s"])
    assert math.isfinite(result["steady_overhead"]) and result["steady_overhead"] > -1


def test_s3_sync_smoke_uploads_and_downloads_on_every_side(tmp_path):
    """The benchmark starts its own S3 server on loopback (SeaweedFS ``weed mini``, as the
    ``s3_server`` fixture does), so the smoke needs only the ``weed`` binary."""
    result = smoke("s3_sync", tmp_path / "s3_sync.json", 300)
    assert result["checkpoint_mb"] > 40 and result["rounds"] == 1 and result["down_rounds"] == 1
    sides = ("ours_up", "raw_up", "raw_checked_up", "ours_down", "raw_down", "local_copy")
    for side in sides:
        assert result["seconds"][side] and all(t > 0 for t in result["seconds"][side]), side
        assert result["mb_per_s"][side] > 0, side
    for ratio in ("upload_vs_raw", "upload_vs_raw_checked", "download_vs_raw", "upload_vs_raw_paired"):
        assert result[ratio] > 0, ratio
    assert result["download_vs_raw_paired"] > 0 and result["upload_vs_local_copy"] > 0


@pytest.mark.e2e  # it starts an embedded Airflow stack
@pytest.mark.long_smoke
def test_overhead_smoke_times_torchrun_and_the_dag(tmp_path):
    result = smoke("overhead", tmp_path / "overhead.json", 900)
    assert result["torchrun_median_s"] > 0 and result["dag_median_s"] > 0 and result["ratio"] > 0
    tasks = result["dag_task_breakdown"][0]
    for task in ("shard_train[0]", "shard_train[1]", "evaluate"):
        assert tasks[task]["duration_s"] > 0, task
