"""Run plots written next to the JSON report (PNG, matplotlib's Agg backend)."""

from __future__ import annotations

from pathlib import Path

from trainflow import timeline

_MARKS = {
    "fault_injected": ("tab:red", "fault"),
    "stall_detected": ("tab:orange", "detected"),
    "resumed": ("tab:green", "resumed"),
    "user_error": ("black", "user error"),
    "crash_loop": ("black", "crash loop"),
    "checkpoint_failed": ("tab:purple", "save failed"),
    "membership": ("tab:blue", "gang size/members changed"),
    "grow_window": ("tab:cyan", "grow window"),
}


def throughput_series(curve: list[dict], *, global_batch: int | None = None) -> list[tuple[float, float]]:
    """The gang's samples per second between consecutive loss-curve points: Δstep × global
    batch ÷ Δt, at the later point's time. A point's own ``global_batch`` (the batch at the
    world size it trained with) wins over the argument; a pair whose step does not advance
    (a redo after a fault begins) gives nothing. Pure."""
    out = []
    for a, b in zip(curve, curve[1:]):
        batch = b.get("global_batch", global_batch)
        if batch is None or b["step"] <= a["step"] or b["time"] <= a["time"]:
            continue
        out.append((b["time"], (b["step"] - a["step"]) * batch / (b["time"] - a["time"])))
    return out


def _plan_global_batch(run_dir: Path) -> int | None:
    import json

    try:
        plan = json.loads((Path(run_dir) / "plan.json").read_text())
        return int(plan["spec"]["batch_size"]) * int(plan["world_size"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def progress_plot(run_dir: Path, out: Path | None = None) -> Path | None:
    """Progress, faults, recovery, throughput and loss of a run, in three panels.

    Top: step over time (from the timeline and rank 0's curve), with
    faults, detections and resumes marked, each fault's downtime shaded up to its resume,
    and the run's goodput in the title. Middle: the gang's samples/s over the same time
    (``throughput_series``), downtimes shaded. Bottom: rank 0's training loss over steps
    (``curve.jsonl``); the steps redone after a fault are drawn again on top. Returns the
    PNG path, or None when the timeline has no progress yet.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from trainflow.goodput import fault_records, summarize

    events = timeline.read(run_dir)
    points = [
        (e["time"], e["step"])
        for e in events
        if e["event"] in ("gang_start", "first_step", "checkpoint_stall", "resumed") and "step" in e
    ]
    if not points:
        return None
    curve = timeline.read_lines(Path(run_dir) / "curve.jsonl")
    points = sorted(points + [(c["time"], c["step"]) for c in curve])
    t0 = min(t for t, _ in points)
    t1 = max([t for t, _ in points] + [c["time"] for c in curve])
    fig, (ax, tx, lx) = plt.subplots(3, 1, figsize=(8, 8.5), dpi=100, gridspec_kw={"height_ratios": [3, 2, 2]})
    ax.plot([t - t0 for t, _ in points], [s for _, s in points], lw=1.2, label="step")
    seen = set()
    for e in events:
        if e["event"] in _MARKS:
            color, label = _MARKS[e["event"]]
            ax.axvline(e["time"] - t0, color=color, ls="--", lw=1, label=None if label in seen else label)
            seen.add(label)
    for f in fault_records(events):
        if "resumed_time" in f:
            ax.axvspan(
                f["time"] - t0,
                f["resumed_time"] - t0,
                color="tab:red",
                alpha=0.12,
                label=None if "downtime" in seen else "downtime",
            )
            seen.add("downtime")
    steps = max(s for _, s in points)
    good = summarize(run_dir, started=t0, ended=t1, steps=steps)
    ax.set_xlabel("seconds since the gang started")
    ax.set_ylabel("step")
    ax.set_title(
        f"{Path(run_dir).name}: goodput {100 * good['goodput']:.1f}% — "
        f"{len(good['faults'])} faults, {good['recovery_s']:.1f}s recovering, "
        f"{good['steps_lost']} steps redone",
        fontsize=9,
    )
    ax.legend(loc="lower right", fontsize=8)
    ax.grid(alpha=0.3)
    # Throughput over the same time axis, the downtimes shaded again.
    rate = throughput_series(curve, global_batch=_plan_global_batch(run_dir))
    if rate:
        tx.plot([t - t0 for t, _ in rate], [r for _, r in rate], lw=1, color="tab:green", label="samples/s (gang)")
        tx.legend(loc="lower right", fontsize=8)
    for f in fault_records(events):
        if "resumed_time" in f:
            tx.axvspan(f["time"] - t0, f["resumed_time"] - t0, color="tab:red", alpha=0.12)
    tx.set_xlim(ax.get_xlim())
    tx.set_xlabel("seconds since the gang started")
    tx.set_ylabel("throughput (samples/s)")
    tx.grid(alpha=0.3)
    # One line per stretch of monotonically increasing steps: a redo starts a new line.
    runs: list[list[dict]] = []
    for c in curve:
        if not runs or c["step"] <= runs[-1][-1]["step"]:
            runs.append([])
        runs[-1].append(c)
    for i, part in enumerate(runs):
        lx.plot(
            [c["step"] for c in part],
            [c["loss"] for c in part],
            lw=1,
            label="loss" if i == 0 else ("redone after a fault" if i == 1 else None),
        )
    lx.set_xlabel("step")
    lx.set_ylabel("training loss (rank 0)")
    if curve:
        lx.legend(loc="upper right", fontsize=8)
    lx.grid(alpha=0.3)
    fig.tight_layout()
    out = Path(out or Path(run_dir) / "progress.png")
    fig.savefig(out)
    plt.close(fig)
    return out
