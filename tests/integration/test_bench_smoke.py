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
