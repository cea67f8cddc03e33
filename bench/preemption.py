"""bench/preemption: what preempting a preemptible run buys a higher-priority one, and what
it costs the preempted run, side by side in one run.

On the real embedded stack (api-server, scheduler, dag-processor, triggerer; LocalExecutor;
a pool of 4 node slots): a 2-node digits run of 3000 steps trains; once both its ranks are
past step 400, a 3-node run of priority 10 arrives and cannot fit. Alternating, per round:

- baseline: the running run is not preemptible, so the priority run waits until it ends;
- preemption: the running run is ``preemptible``: it is ordered to stop, commits a
  checkpoint of the step it is at, gives its nodes back and waits in the queue; the priority
  run trains; the preempted run is admitted again and resumes from that very step.

Measured: the priority run's wait, trigger → its first training step (its timeline), in
both modes (the ratio); for the preempted run, order → stop (the gang at a committed
checkpoint), stop → nodes back in the pool, time waiting in the queue, re-admission → the
gang training again, steps redone, and its final weights against a clean run of the same spec.

    .venv/bin/python bench/preemption.py [--rounds 2]
    .venv/bin/python bench/preemption.py --smoke    # run by TRAINFLOW_LONG_SMOKES=1 scripts/test

Writes bench/results/preemption.json (preemption_smoke.json with --smoke).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from _results import embedded_stack, side_by_side  # noqa: E402

DAG = "train_digits"
LOW = {
    "nodes": 2,
    "steps": 3000,
    "checkpoint_interval": 250,
    "heartbeat_interval": 0.5,
    "heartbeat_timeout": 8.0,
    "startup_timeout": 120.0,
    "tenant": "bench",
    "seed": 11,
}
HIGH = {
    "nodes": 3,
    "steps": 60,
    "checkpoint_interval": 30,
    "heartbeat_interval": 0.5,
    "heartbeat_timeout": 8.0,
    "startup_timeout": 120.0,
    "priority": 10,
    "tenant": "bench-hi",
    "seed": 3,
}
ARRIVE_AFTER_STEP = 400
# --smoke: one round of each mode, the low run 1000 steps long, the priority run arriving past
# step 200 (still off the checkpoint interval, so a preempted run stops between checkpoints).
SMOKE_LOW_STEPS, SMOKE_ARRIVE_AFTER_STEP = 1000, 200


def _events(client, run_id: str, event: str) -> list[dict]:
    from trainflow.timeline import read

    run_dir = client.xcom(DAG, run_id, "provision", "run_dir")
    return [e for e in read(run_dir) if e["event"] == event]


def _wait_training(client, run_id: str, past_step: int, timeout: float = 600) -> None:
    from trainflow.heartbeat import read_all

    deadline = time.time() + timeout
    while time.time() < deadline:
        states = {t["task_id"]: t["state"] for t in client.task_instances(DAG, run_id)}
        if states.get("provision") == "success":
            beats = read_all(f"{client.xcom(DAG, run_id, 'provision', 'run_dir')}/heartbeats")
            if len(beats) == LOW["nodes"] and min(b["step"] for b in beats.values()) > past_step:
                return
        time.sleep(0.5)
    raise RuntimeError(f"{run_id} did not pass step {past_step} in {timeout:.0f} s")


def _ok(client, run_id: str, timeout: float = 1200) -> None:
    run = client.wait_run(DAG, run_id, timeout=timeout, poll=0.5)
    if run["state"] != "success":
        raise RuntimeError(f"run {run_id} ended {run['state']}")


def round_(
    client, stamp: str, *, preemptible: bool, clean: str, low_conf: dict = LOW, arrive_after: int = ARRIVE_AFTER_STEP
) -> dict:
    """One low run and one priority run arriving mid-way; the priority run's wait and, when
    preempted, the preempted run's costs."""
    low, high = f"bench-low-{stamp}", f"bench-high-{stamp}"
    client.trigger(DAG, {**low_conf, "preemptible": preemptible}, run_id=low)
    _wait_training(client, low, arrive_after)
    arrived = time.time()
    client.trigger(DAG, HIGH, run_id=high)
    _ok(client, high)
    _ok(client, low)
    (first,) = _events(client, high, "first_step")
    out = {
        "priority_wait_s": round(first["time"] - arrived, 2),
        "low_weights_equal_clean": client.xcom(DAG, low, "evaluate", "metrics")["weights_sha256"] == clean,
    }
    if preemptible:
        ordered = min(e["time"] for e in _events(client, low, "preempt_ordered"))
        (stop,) = _events(client, low, "preempted")
        requeued = min(e["time"] for e in _events(client, low, "requeued"))
        readmitted = _events(client, low, "readmitted")
        again = min(e["time"] for e in readmitted)
        resumed = [e for e in _events(client, low, "resumed") if e["time"] >= again]
        out.update(
            order_to_stop_s=round(stop["time"] - ordered, 3),
            stop_to_nodes_back_s=round(requeued - stop["time"], 3),
            queue_wait_s=round(max(e["waited_s"] for e in readmitted), 2),
            readmitted_to_training_s=round(resumed[0]["time"] - again, 2),
            stopped_at_step=stop["step"],
            resumed_at_step=resumed[0]["step"],
            steps_redone=stop["step"] - resumed[0]["step"],
        )
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None, help="default bench/results/preemption.json")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help=f"one round of each mode, a {SMOKE_LOW_STEPS}-step low run, the priority run past step "
        f"{SMOKE_ARRIVE_AFTER_STEP} (run by TRAINFLOW_LONG_SMOKES=1 scripts/test)",
    )
    args = parser.parse_args()
    low_conf, arrive_after = LOW, ARRIVE_AFTER_STEP
    if args.smoke:
        args.rounds = 1
        low_conf, arrive_after = {**LOW, "steps": SMOKE_LOW_STEPS}, SMOKE_ARRIVE_AFTER_STEP
    args.out = args.out or REPO / "bench" / "results" / ("preemption_smoke.json" if args.smoke else "preemption.json")
    waits: dict[str, list[float]] = {"none": [], "preempt": []}
    preempted: list[dict] = []
    with embedded_stack("tf-preempt-bench-", node_slots=4) as stack:
        client = stack.client()
        client.wait_for_dag(DAG, timeout=180)
        client.unpause(DAG)
        stamp = int(time.time())
        client.trigger(DAG, low_conf, run_id=f"bench-clean-{stamp}")
        _ok(client, f"bench-clean-{stamp}")
        clean = client.xcom(DAG, f"bench-clean-{stamp}", "evaluate", "metrics")["weights_sha256"]
        for i in range(args.rounds):
            for mode in ("none", "preempt"):
                r = round_(
                    client,
                    f"{stamp}-{i}-{mode}",
                    preemptible=mode == "preempt",
                    clean=clean,
                    low_conf=low_conf,
                    arrive_after=arrive_after,
                )
                if not r["low_weights_equal_clean"]:
                    raise RuntimeError(f"round {i} ({mode}): the low run's weights differ from the clean run's")
                waits[mode].append(r["priority_wait_s"])
                if mode == "preempt":
                    preempted.append(r)
                print(f"round {i + 1} {mode}: {r}", flush=True)
    summary = {
        k: statistics.median(r[k] for r in preempted)
        for k in ("order_to_stop_s", "stop_to_nodes_back_s", "queue_wait_s", "readmitted_to_training_s")
    }
    side_by_side(
        "preemption",
        args.out,
        ("priority_wait_no_preemption", waits["none"]),
        ("priority_wait_with_preemption", waits["preempt"]),
        rounds=args.rounds,
        low=low_conf,
        high=HIGH,
        arrive_after_step=arrive_after,
        preempted_runs=preempted,
        preempted_medians=summary,
        steps_redone=[r["steps_redone"] for r in preempted],
    )
    print(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
