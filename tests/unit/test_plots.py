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
