"""bench/spare: recovery from a lost node with a hot spare vs by Airflow's retry, in one run.

On the real embedded stack (api-server, scheduler, dag-processor, triggerer; LocalExecutor):
the same digits run (2 nodes) with its rank-1 node task SIGKILLed at the same step, once with
``spares: 1`` and once without, alternating for ``--rounds`` rounds. Recovery is the
run's own goodput record of the fault: kill → the resumed gang's first resume (timeline).
Without a spare the lost node is replaced by Airflow's retry (task failure noticed, 1 s
retry delay, a new task process, preflight, agent, zygote, rendezvous); with a spare, the
spare joins the survivors' next rendezvous round at once.

    .venv/bin/python bench/spare.py [--rounds 3]
    .venv/bin/python bench/spare.py --smoke    # one round of 120 steps: run by TRAINFLOW_LONG_SMOKES=1 scripts/test

Writes bench/results/spare.json (spare_smoke.json with ``--smoke``, whose figures are not a
measurement); goal: a spare recovers faster than the retry path.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from _results import embedded_stack, side_by_side  # noqa: E402

DAG = "train_digits"
CONF = {
    "nodes": 2,
    "steps": 600,
    "checkpoint_interval": 50,
    "heartbeat_interval": 0.5,
    "heartbeat_timeout": 20.0,
    "startup_timeout": 120.0,
    "tenant": "bench",
    "seed": 5,
    "batch_size": 16,
    "faults": [{"kind": "kill_node", "rank": 1, "step": 200}],
}
# --smoke (one round of both sides): a fifth of the steps, a checkpoint every 20, the kill at step 60.
SMOKE = {"steps": 120, "checkpoint_interval": 20, "faults": [{"kind": "kill_node", "rank": 1, "step": 60}]}


def recovery(client, conf: dict, run_id: str) -> float:
    client.trigger(DAG, conf, run_id=run_id)
    run = client.wait_run(DAG, run_id, timeout=900, poll=0.5)
    if run["state"] != "success":
        raise RuntimeError(f"run {run_id} ended {run['state']}")
    (fault,) = client.xcom(DAG, run_id, "evaluate", "goodput")["faults"]
    return float(fault["recovery_s"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None, help="default bench/results/spare.json")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="one round of 120 steps, the kill at step 60 (run by TRAINFLOW_LONG_SMOKES=1 scripts/test)",
    )
    args = parser.parse_args()
    conf = {**CONF, **SMOKE} if args.smoke else CONF
    if args.smoke:
        args.rounds = 1
    args.out = args.out or REPO / "bench" / "results" / ("spare_smoke.json" if args.smoke else "spare.json")
    retry, spare = [], []
    with embedded_stack("tf-spare-bench-", node_slots=3, allow_faults=True) as stack:
        client = stack.client()
        client.wait_for_dag(DAG, timeout=180)
        client.unpause(DAG)
        stamp = int(time.time())
        for i in range(args.rounds):
            retry.append(recovery(client, conf, f"bench-retry-{stamp}-{i}"))
            spare.append(recovery(client, {**conf, "spares": 1}, f"bench-spare-{stamp}-{i}"))
            print(f"round {i + 1}: retry {retry[-1]:.2f}s, spare {spare[-1]:.2f}s", flush=True)
    side_by_side(
        "spare",
        args.out,
        ("airflow_retry", retry),
        ("hot_spare", spare),
        rounds=args.rounds,
        conf=conf,
        smoke=args.smoke,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
