"""How bench/goodput measures goodput against the clock (``clock_goodput``): faults are
charged everything they cost, the machine's own drift nothing."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def bench():
    path = Path(__file__).resolve().parents[2] / "bench" / "goodput.py"
    spec = importlib.util.spec_from_file_location("bench_goodput", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _trace(bench, *, faults=(), cost=0.0, redo=0, seconds=300.0):
    """A gang sampled every 0.1 s whose speed drifts from 120 to 90 steps/s over the run;
    each fault freezes it for ``cost`` s and sends it back ``redo`` steps."""
    trace = bench.Trace()
    t, step, frozen_until, pending = 1000.0, 0.0, 0.0, sorted(faults)
    while t < 1000.0 + seconds:
        if t >= frozen_until:
            step += (120 - 30 * (t - 1000.0) / seconds) * 0.1
        trace.samples.append((t, int(step)))
        if pending and t - 1000.0 >= pending[0]:  # as the bench: sampled, then the fault
            trace.faults.append(t)
            pending.pop(0)
            frozen_until, step = t + cost, step - redo
        t += 0.1
    return trace, int(step)


def test_a_run_without_faults_scores_one_whatever_the_drift(bench):
    trace, steps = _trace(bench)
    result = bench.clock_goodput(trace, steps, period=60)
    assert result["goodput"] == pytest.approx(1.0, abs=0.005)
    # Against its first minute's rate, the same run would have looked 12 % worse.
    first = trace.rate(1000.0, 1060.0)
    assert steps / first / result["wall_s"] < 0.9


def test_each_fault_is_charged_its_frozen_time_and_its_redone_steps(bench):
    faults = (60, 120, 180, 240)
    trace, steps = _trace(bench, faults=faults, cost=3.0, redo=50)
    result = bench.clock_goodput(trace, steps, period=60)
    wall = result["wall_s"]
    # Each fault: 3 s frozen plus 50 steps redone at ~100 steps/s ≈ 3.5 s.
    assert result["goodput"] == pytest.approx((wall - 4 * 3.5) / wall, abs=0.006)
    assert len(result["pieces"]) == 5 and not any(p["rate_borrowed"] for p in result["pieces"])


def test_a_fault_too_near_the_end_to_measure_its_piece_is_still_charged(bench):
    trace, steps = _trace(bench, faults=(100, 292), cost=3.0)
    result = bench.clock_goodput(trace, steps, period=60)
    last = result["pieces"][-1]
    assert last["rate_borrowed"] and last["clean_s"] < last["wall_s"] - 2.5
