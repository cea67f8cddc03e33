"""Run plots written next to the JSON report (PNG, matplotlib's Agg backend)."""

from __future__ import annotations

from pathlib import Path

from trainflow import timeline

_MARKS = {"fault_injected": ("tab:red", "fault"), "stall_detected": ("tab:orange", "detected"),
          "resumed": ("tab:green", "resumed"), "user_error": ("black", "user error"),
          "crash_loop": ("black", "crash loop"), "checkpoint_failed": ("tab:purple", "save failed")}


def progress_plot(run_dir: Path, out: Path | None = None) -> Path | None:
    """Training progress (step over time) with faults, detections and resumes marked.

    Progress points come from the timeline (gang starts, first steps, checkpoints), so the
    plot shows the steps redone after each fault. Returns the PNG path, or None when the
    timeline has no progress yet.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    events = timeline.read(run_dir)
    points = [(e["time"], e["step"]) for e in events
              if e["event"] in ("gang_start", "first_step", "checkpoint_stall", "resumed") and "step" in e]
    if not points:
        return None
    t0 = min(t for t, _ in points)
    fig, ax = plt.subplots(figsize=(8, 3.5), dpi=100)
    ax.plot([t - t0 for t, _ in points], [s for _, s in points], marker=".", lw=1.2, label="step")
    seen = set()
    for e in events:
        if e["event"] in _MARKS:
            color, label = _MARKS[e["event"]]
            ax.axvline(e["time"] - t0, color=color, ls="--", lw=1,
                       label=None if label in seen else label)
            seen.add(label)
    ax.set_xlabel("seconds since the gang started")
    ax.set_ylabel("step (starts and checkpoints)")
    ax.set_title(f"progress and faults — {Path(run_dir).name}", fontsize=10)
    ax.legend(loc="lower right", fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    out = Path(out or Path(run_dir) / "progress.png")
    fig.savefig(out)
    plt.close(fig)
    return out
