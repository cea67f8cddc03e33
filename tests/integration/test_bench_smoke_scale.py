"""More benchmarks keep running: the ``--smoke`` mode (tiny sizes, every side and part) of the
scaling, hot-spare and GPU-check benchmarks runs here, so a code change that breaks one fails
the suite. The two that start an Airflow stack of their own are e2e."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _smoke(name: str, out: Path, timeout: int) -> dict:
    subprocess.run(
        [sys.executable, str(REPO / "bench" / f"{name}.py"), "--smoke", "--out", str(out)], check=True, timeout=timeout
    )
    return json.loads(out.read_text())


def _curve(seconds: list[float], sizes: list) -> None:
    assert len(seconds) == len(sizes) and all(s > 0 for s in seconds), (sizes, seconds)


@pytest.mark.e2e  # the dag part starts an embedded stack
@pytest.mark.long_smoke
def test_scaling_smoke_measures_every_curve(tmp_path):
    out = tmp_path / "scaling.json"
    result = _smoke("scaling", out, timeout=900)
    assert result["smoke"] is True
    sim = result["sim"]
    assert sim["traces_jobs"] < sim["sizes"][-1]  # the largest size repeats the trace past its end
    for policy in ("fifo", "backfill"):
        _curve(sim[policy]["seconds"], sim["sizes"])
        assert isinstance(sim[policy]["exponent"], float)
    _curve(result["admission"]["seconds"], result["admission"]["queued"])
    _curve(result["heartbeat"]["seconds"], result["heartbeat"]["ranks"])
    ckpt = result["checkpoint"]
    _curve(ckpt["save_s"], ckpt["params_m"])
    _curve(ckpt["load_s"], ckpt["params_m"])
    assert ckpt["bytes"] == sorted(ckpt["bytes"]) and ckpt["bytes"][0] > 4 * 10**6  # weights + Adam state
    dag = result["dag"]
    _curve(dag["train_s"], dag["nodes"])
    _curve(dag["overhead_s"], dag["nodes"])
    assert out.with_suffix(".png").stat().st_size > 0


@pytest.mark.e2e  # an embedded stack of its own
@pytest.mark.long_smoke
def test_spare_smoke_recovers_a_lost_node_by_retry_and_by_spare(tmp_path):
    result = _smoke("spare", tmp_path / "spare.json", timeout=900)
    assert result["smoke"] is True and result["rounds"] == 1
    assert 0 < result["airflow_retry_median_s"] < 300 and 0 < result["hot_spare_median_s"] < 300
    assert result["ratio"] > 0


def test_gpu_check_smoke_trains_compares_and_resumes_on_the_device_it_has(tmp_path):
    """On a host without an NVIDIA GPU the GPU side runs on the CPU (gloo), through the same code."""
    result = _smoke("gpu_check", tmp_path / "gpu_check.json", timeout=600)
    assert result["smoke"] is True and result["device"] in ("cpu", "cuda")
    for side in ("cpu", "gpu"):
        assert result[side]["wall_s"] > 0 and result[side]["accuracy"] > 0.5, result[side]
        assert len(result[side]["weights_sha256"]) == 64
    assert 0 < result["resume"]["killed_at_step"] < result["steps"]  # killed mid-run, not after the end
    assert result["resume"]["bit_identical"] is True and result["ok"] is True
