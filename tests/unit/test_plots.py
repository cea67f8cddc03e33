from __future__ import annotations

from trainflow.plots import progress_plot
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
