"""bench/goodput: a ~10-minute run with a fault every 60 s, trainflow vs plain retries.

Both sides train the same spec (digits, 2 nodes × 1 rank, gloo) on this machine, and
every ``--every`` seconds of wall time a rank's worker is SIGKILLed (ranks 1, 0, 1, ...;
a fault that falls due while the gang is still restarting waits until every rank trains
again):

- trainflow: the node agents restart the gang, which resumes from the newest verified
  checkpoint. Goodput is measured from the run's fault timeline
  (``trainflow.goodput.summarize``: 1 − (recovery + redone steps) / wall) and against
  the clock, three ways: with the machine's speed measured beside each fault
  (``clock_goodput``: the figure the goal is judged by; the same method on the clean run
  is its control and reads 1.000 when the method charges nothing that is not a fault);
  (steps / clean step rate) / wall, the clean rate measured by a fault-free calibration
  gang first; and the wall time of the same run without faults / wall (a clean run of
  the same steps goes first). The last two compare runs minutes apart, so they carry the
  machine's drift (108–123 steps/s on this machine within tens of minutes).
- baseline, plain Airflow retries without resume: each fault fails the attempt and the
  retry starts over from step 0 in a fresh workspace (retry delay 0, generous to it).
  It is given ``--baseline-attempts`` attempts; a run that never finishes keeps no work,
  so its goodput is 0 however long it runs.

    .venv/bin/python bench/goodput.py [--minutes 10] [--every 60]
    .venv/bin/python bench/goodput.py --smoke    # about 2 minutes: run by TRAINFLOW_LONG_SMOKES=1 scripts/test

Writes bench/results/goodput.json (goodput_smoke.json with --smoke). Goal: trainflow goodput ≥ 95%.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from trainflow.cli import chaos  # noqa: E402
from trainflow.goodput import summarize  # noqa: E402
from trainflow.heartbeat import read_all  # noqa: E402
from trainflow.launch.local import gang  # noqa: E402
from trainflow.spec import TrainingSpec  # noqa: E402
from trainflow.timeline import read as read_timeline  # noqa: E402

BASE = dict(
    workload="digits",
    nodes=2,
    nproc_per_node=1,
    batch_size=16,
    checkpoint_interval=50,
    seed=3,
    crash_loop_limit=100,
    heartbeat_interval=0.5,
)


def clean_rate(work: Path, seconds: float = 60.0, settle: float = 10.0) -> float:
    """Steps per second of a fault-free gang over ``seconds``, measured after its first
    ``settle`` s of training."""
    spec = TrainingSpec.from_mapping({**BASE, "steps": 10_000_000})
    run_dir = work / "calibration"
    with gang(spec, run_dir):

        def step() -> int:
            return _gang_step(run_dir, spec.world_size)

        deadline = time.time() + 120
        while step() < 100 and time.time() < deadline:
            time.sleep(0.2)
        time.sleep(settle)
        s0, t0 = step(), time.time()
        time.sleep(seconds)
        return (step() - s0) / (time.time() - t0)


def _training(run_dir: Path, world: int) -> bool:
    """Every rank is training (a fault due while the gang restarts waits for it)."""
    beats = read_all(run_dir / "heartbeats")

    def alive(pid: int) -> bool:
        try:
            os.kill(pid, 0)
            return True
        except ProcessLookupError:
            return False

    return len(beats) == world and all(
        b["state"] == "training" and time.time() - b["time"] < 2 and alive(int(b["pid"])) for b in beats.values()
    )


def _gang_step(run_dir: Path, world: int) -> int:
    """The step every rank has reached (0 until every rank has beaten)."""
    beats = read_all(run_dir / "heartbeats")
    return min((b["step"] for b in beats.values()), default=0) if len(beats) == world else 0


class Trace:
    """What the bench saw of a run: (time, gang step) every 0.1 s and when each fault fell."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, int]] = []
        self.faults: list[float] = []

    def step_at(self, t: float) -> int:
        """The gang step of the last sample at or before ``t``."""
        return max((s for ts, s in self.samples if ts <= t), default=0)

    def rate(self, t0: float, t1: float) -> float | None:
        """Steps per second between ``t0`` and ``t1`` (None: no samples there)."""
        inside = [(t, s) for t, s in self.samples if t0 <= t <= t1]
        if len(inside) < 2 or inside[-1][0] - inside[0][0] < 5:
            return None
        return (inside[-1][1] - inside[0][1]) / (inside[-1][0] - inside[0][0])


def clock_goodput(trace: Trace, steps: int, period: float, settle: float = 10.0) -> dict:
    """Goodput against the clock with the machine's speed measured beside each fault.

    The run's wall time (first training step → last) is cut at the faults (or every
    ``period`` s for a run without faults: the control). In each piece the gang made net
    progress ``Δs`` (redone steps are not progress), and the piece's steady rate ``r`` is
    measured in the same piece, from ``settle`` s after its start to its end: the time a
    fault-free gang would have needed is ``Δs / r``. Goodput = Σ Δs/r ÷ wall. Everything
    a fault costs (the dead rank's wait, restart, reload, redone steps, a slow first
    minute after it) is charged to it; a change of the machine's own speed over the run
    (the calibration is measured minutes apart: 108–120 steps/s on this machine within a
    few minutes) is not."""
    start = next(t for t, s in trace.samples if s > 0)
    end = next((t for t, s in trace.samples if s >= steps), trace.samples[-1][0])
    cuts = list(trace.faults) or [start + period * k for k in range(1, int((end - start) // period) + 1)]
    bounds = [start] + [c for c in cuts if start < c < end] + [end]
    spans = list(zip(bounds, bounds[1:]))
    # The first piece starts at the first step: its steady part needs no settling.
    rates = [trace.rate(t0 + (settle if t0 != start else 0.0), t1) for t0, t1 in spans]
    if not any(rates):
        raise ValueError("no piece of the run was long enough to measure its rate")
    # A piece too short to measure (a fault near the end) takes its neighbour's rate: its
    # fault is still charged, never left out.
    borrowed = [r is None for r in rates]
    for i in [*range(len(rates)), *reversed(range(len(rates)))]:
        if rates[i] is None:
            rates[i] = rates[i - 1] if i > 0 and rates[i - 1] else (rates[i + 1] if i + 1 < len(rates) else None)
    pieces = []
    for (t0, t1), r, b in zip(spans, rates, borrowed):
        ds = trace.step_at(t1) - trace.step_at(t0) if t1 != end else steps - trace.step_at(t0)
        pieces.append(
            {
                "wall_s": round(t1 - t0, 2),
                "steps": ds,
                "steps_per_s": round(r, 1),
                "rate_borrowed": b,
                "clean_s": round(ds / r, 2),
            }
        )
    return {
        "goodput": sum(p["clean_s"] for p in pieces) / (end - start),
        "wall_s": round(end - start, 1),
        "pieces": pieces,
    }


def _faulty(
    spec: TrainingSpec, run_dir: Path, every: float, limit: float, max_faults: float = float("inf")
) -> tuple[list[int], float, int, Trace]:
    """Run ``spec`` killing a rank every ``every`` s (at most ``max_faults`` times); return
    exit codes, wall, faults and the trace of its progress."""
    trace = Trace()
    with gang(spec, run_dir) as procs:
        t0, faults = time.time(), 0
        while any(p.poll() is None for p in procs) and time.time() - t0 < limit:
            trace.samples.append((time.time(), _gang_step(run_dir, spec.world_size)))
            due = faults < max_faults and time.time() - t0 >= every * (faults + 1)
            if due and _training(run_dir, spec.world_size):
                trace.faults.append(time.time())
                chaos(run_dir, "kill_rank", 1 if faults % 2 == 0 else 0)
                faults += 1
            time.sleep(0.1)
        trace.samples.append((time.time(), _gang_step(run_dir, spec.world_size)))
        return [p.poll() for p in procs], time.time() - t0, faults, trace


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--every", type=float, default=60.0)
    parser.add_argument("--baseline-attempts", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None, help="default bench/results/goodput.json")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="every side, tiny: a 5 s calibration, 18 s of training, one fault 10 s in, one baseline "
        "attempt (run by TRAINFLOW_LONG_SMOKES=1 scripts/test)",
    )
    args = parser.parse_args()
    calibration, settle, max_faults = {"seconds": 60.0, "settle": 10.0}, 10.0, float("inf")
    if args.smoke:
        # One fault, so that the piece after it is long enough to measure its rate however
        # slowly the gang starts; the figures are not a measurement.
        args.minutes, args.every, args.baseline_attempts = 0.3, 10.0, 1
        calibration, settle, max_faults = {"seconds": 5.0, "settle": 2.0}, 2.0, 1
    args.out = args.out or REPO / "bench" / "results" / ("goodput_smoke.json" if args.smoke else "goodput.json")
    work = Path(tempfile.mkdtemp(prefix="tf-goodput-"))
    rate = clean_rate(work, **calibration)
    steps = int(rate * args.minutes * 60)
    spec = TrainingSpec.from_mapping({**BASE, "steps": steps})
    clean_wall = steps / rate
    # A short run's limit still leaves room for the gang's start and each recovery.
    limit = max(4 * clean_wall, 300.0)
    print(f"clean rate {rate:.1f} steps/s → {steps} steps ≈ {clean_wall:.0f}s", flush=True)

    # The same run without faults: what the clock costs a run that never fails (gang
    # start-up, checkpoints, the end), for goodput against a clean run's wall time.
    c_codes, c_wall, _, c_trace = _faulty(spec, work / "clean", float("inf"), limit=limit)
    control = clock_goodput(c_trace, steps, args.every, settle=settle)
    clean_run = {
        "exit_codes": c_codes,
        "wall_s": c_wall,
        "completed": c_codes == [0, 0],
        "goodput_clock_local_rate": control["goodput"],
        "clock_local_rate": control,
    }
    print(f"clean run: {c_wall:.1f}s; the local-rate method on it (no faults): {control['goodput']:.3f}", flush=True)

    run_dir = work / "trainflow"
    codes, wall, faults, trace = _faulty(spec, run_dir, args.every, limit=limit, max_faults=max_faults)
    local = clock_goodput(trace, steps, args.every, settle=settle)
    events = read_timeline(run_dir)
    first = next(e["time"] for e in events if e["event"] == "gang_start")
    summary = summarize(run_dir, started=first, ended=first + wall, steps=steps)
    trainflow = {
        "exit_codes": codes,
        "wall_s": wall,
        "faults": faults,
        "completed": codes == [0, 0],
        "goodput_timeline": summary["goodput"],
        "goodput_clock_local_rate": local["goodput"],
        "goodput_clock": clean_wall / wall,
        "goodput_vs_clean_run": c_wall / wall if clean_run["completed"] else None,
        "recovery_s": summary["recovery_s"],
        "steps_lost": summary["steps_lost"],
        "per_fault": [{k: f.get(k) for k in ("kind", "step", "recovery_s", "steps_lost")} for f in summary["faults"]],
        "clock_local_rate": local,
    }
    print(json.dumps({k: v for k, v in trainflow.items() if k not in ("per_fault", "clock_local_rate")}), flush=True)

    attempts = []
    for i in range(args.baseline_attempts):  # no resume: every retry starts from step 0
        a_dir = work / f"baseline-{i}"
        a_codes, a_wall, a_faults, _ = _faulty(spec, a_dir, args.every, limit=args.every + 30, max_faults=max_faults)
        reached = max((e["step"] for e in read_timeline(a_dir) if e["event"] == "checkpoint_stall"), default=0)
        attempts.append(
            {
                "exit_codes": a_codes,
                "wall_s": a_wall,
                "reached_step": reached,
                "completed": a_codes == [0, 0] and a_faults == 0,
            }
        )
        print(f"baseline attempt {i}: reached step {reached} of {steps} before its fault", flush=True)
        if attempts[-1]["completed"]:
            break
    done = any(a["completed"] for a in attempts)
    baseline = {
        "attempts": attempts,
        "completed": done,
        "goodput": clean_wall / sum(a["wall_s"] for a in attempts) if done else 0.0,
        "why": None
        if done
        else f"each attempt starts over and is killed after {args.every:g}s; "
        f"the run needs {clean_wall:.0f}s uninterrupted",
    }
    result = {
        "bench": "goodput",
        "spec": {**BASE, "steps": steps},
        "every_s": args.every,
        "clean_steps_per_s": rate,
        "clean_wall_s": clean_wall,
        "clean_run": clean_run,
        "trainflow": trainflow,
        "plain_retries": baseline,
        "machine": {"cpus": os.cpu_count()},
        "time": time.time(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(
        json.dumps(
            {
                "trainflow_goodput_timeline": trainflow["goodput_timeline"],
                "trainflow_goodput_clock_local_rate": trainflow["goodput_clock_local_rate"],
                "control_clean_run_local_rate": clean_run["goodput_clock_local_rate"],
                "trainflow_goodput_clock": trainflow["goodput_clock"],
                "trainflow_goodput_vs_clean_run": trainflow["goodput_vs_clean_run"],
                "plain_retries_goodput": baseline["goodput"],
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
