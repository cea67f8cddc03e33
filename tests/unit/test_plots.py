from __future__ import annotations

import pytest

from trainflow.plots import progress_plot, throughput_series
from trainflow.timeline import record


def test_progress_plot_marks_faults(tmp_path):
    assert progress_plot(tmp_path) is None  # nothing to plot yet
    record(tmp_path, "gang_start", step=0)
    record(tmp_path, "checkpoint_stall", step=50, stall_ms=3.0)
    record(tmp_path, "fault_injected", kind="kill_rank", rank=1, step=60)
    record(tmp_path, "resumed", step=50)
    record(tmp_path, "checkpoint_stall", step=100, stall_ms=3.0)
    png = progress_plot(tmp_path)
    assert png == tmp_path / "progress.png"
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_progress_plot_draws_the_loss_curve_and_the_goodput(tmp_path):
    import time

    from trainflow.timeline import append

    now = time.time()
    record(tmp_path, "gang_start", step=0)
    for step in range(1, 61):
        append(tmp_path / "curve.jsonl", {"time": now + step * 0.01, "step": step, "loss": 2.0 / step})
    record(tmp_path, "fault_injected", kind="kill_rank", rank=1, step=61)
    record(tmp_path, "resumed", step=50)
    for step in range(51, 101):  # steps 51..60 redone
        append(tmp_path / "curve.jsonl", {"time": now + 1 + step * 0.01, "step": step, "loss": 2.0 / step})
    record(tmp_path, "checkpoint_stall", step=100, stall_ms=3.0)
    without = progress_plot(tmp_path, tmp_path / "a.png").read_bytes()
    (tmp_path / "curve.jsonl").unlink()
    bare = progress_plot(tmp_path, tmp_path / "b.png").read_bytes()
    assert without[:8] == b"\x89PNG\r\n\x1a\n" and without != bare  # the curve is drawn


def test_throughput_is_samples_per_second_between_curve_points():
    curve = [
        {"time": 10.0, "step": 0},
        {"time": 12.0, "step": 10},  # 10 steps × 64 in 2 s
        {"time": 13.0, "step": 20, "global_batch": 32},  # a smaller gang's batch wins
        {"time": 20.0, "step": 15},  # a redo after a fault: no rate
        {"time": 21.0, "step": 25},
        {"time": 21.0, "step": 26},
    ]  # no time passed: no rate
    assert throughput_series(curve, global_batch=64) == [(12.0, 320.0), (13.0, 320.0), (21.0, 640.0)]
    assert throughput_series(curve) == [(13.0, 320.0)]  # without a batch only the point that has one
    assert throughput_series(curve[:1], global_batch=64) == []


def test_the_plot_has_a_throughput_panel(tmp_path):
    import json
    import time

    from trainflow.timeline import append

    now = time.time()
    record(tmp_path, "gang_start", step=0)
    (tmp_path / "plan.json").write_text(json.dumps({"world_size": 2, "spec": {"batch_size": 32}}))
    for step in range(1, 41):
        append(tmp_path / "curve.jsonl", {"time": now + step * 0.1, "step": step, "loss": 1.0 / step})
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seen = []
    real = plt.Figure.savefig

    def spy(fig, *a, **kw):
        seen.append([ax.get_ylabel() for ax in fig.axes])
        return real(fig, *a, **kw)

    plt.Figure.savefig = spy
    try:
        progress_plot(tmp_path)
    finally:
        plt.Figure.savefig = real
    assert seen == [["step", "throughput (samples/s)", "training loss (rank 0)"]]
