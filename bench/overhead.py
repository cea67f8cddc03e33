"""bench/overhead: the same training run by raw torchrun and as the DAG via REST.

Same workload, steps and world size; alternating (torchrun, DAG, torchrun, DAG ...) in
one run so drift hits both equally. The baseline does what the DAG does, minus Airflow:
``torchrun`` trains (writing the same checkpoints), then the same evaluation runs. The
DAG time is trigger → run success over REST on an already-running embedded stack.

    .venv/bin/python bench/overhead.py [--rounds 2] [--steps 3000]
    .venv/bin/python bench/overhead.py --smoke    # one round of 12 steps: run by TRAINFLOW_LONG_SMOKES=1 scripts/test

Writes bench/results/overhead.json (overhead_smoke.json with --smoke) and prints the
wall-time ratio (goal ≤ 1.10).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from _results import side_by_side  # noqa: E402

from trainflow.launch.local import free_port  # noqa: E402
from trainflow.spec import TrainingSpec  # noqa: E402
from trainflow.stack import EmbeddedStack  # noqa: E402
from trainflow.workspace import write_json_atomic  # noqa: E402


def run_torchrun(spec: TrainingSpec, work: Path) -> float:
    run_dir = work / f"torchrun-{time.time_ns()}"
    for sub in ("checkpoints", "heartbeats", "control"):
        (run_dir / sub).mkdir(parents=True)
    write_json_atomic(run_dir / "spec.json", spec.to_dict())
    env = {**os.environ, "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo"), "OMP_NUM_THREADS": "1"}
    torchrun = str(Path(sys.executable).parent / "torchrun")
    t0 = time.perf_counter()
    subprocess.run(
        [
            torchrun,
            "--standalone",
            f"--nproc-per-node={spec.world_size}",
            "-m",
            "trainflow.worker.train",
            "--run-dir",
            str(run_dir),
        ],
        env=env,
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    subprocess.run(
        [sys.executable, "-m", "trainflow.worker.evaluate", "--run-dir", str(run_dir)],
        env=env,
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    elapsed = time.perf_counter() - t0
    shutil.rmtree(run_dir)
    return elapsed


def run_dag(client, dag_id: str, conf: dict, i: int, breakdown: list) -> float:
    t0 = time.perf_counter()
    run_id = client.trigger(dag_id, conf, run_id=f"bench-{int(time.time())}-{i}")["dag_run_id"]
    run = client.wait_run(dag_id, run_id, timeout=3600, poll=0.5)
    elapsed = time.perf_counter() - t0
    if run["state"] != "success":
        raise RuntimeError(f"DAG run {run_id} ended {run['state']}")
    breakdown.append(
        {
            f"{t['task_id']}[{t['map_index']}]" if t["map_index"] >= 0 else t["task_id"]: {
                "queued_to_start_s": _secs(t.get("queued_when"), t.get("start_date")),
                "duration_s": t.get("duration"),
            }
            for t in client.task_instances(dag_id, run_id)
        }
    )
    return elapsed


def _secs(a: str | None, b: str | None) -> float | None:
    from datetime import datetime

    if not a or not b:
        return None
    return (datetime.fromisoformat(b) - datetime.fromisoformat(a)).total_seconds()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--out", type=Path, default=None, help="default bench/results/overhead.json")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="one round of 12 steps, a checkpoint every 2 (run by TRAINFLOW_LONG_SMOKES=1 scripts/test)",
    )
    args = parser.parse_args()
    if args.smoke:
        args.rounds, args.steps = 1, 12
    args.out = args.out or REPO / "bench" / "results" / ("overhead_smoke.json" if args.smoke else "overhead.json")
    conf = {
        "workload": "tinylm",
        "nodes": 2,
        "nproc_per_node": 1,
        "steps": args.steps,
        "batch_size": 16,
        "lr": 0.004,
        "checkpoint_interval": max(1, args.steps // 6),
        "heartbeat_timeout": 120.0,
    }
    spec = TrainingSpec.from_mapping(conf)
    work = Path(tempfile.mkdtemp(prefix="tf-bench-"))
    stack = EmbeddedStack(home=work / "airflow", trainflow_home=work / "trainflow", port=free_port())
    stack.up(timeout=300)
    try:
        client = stack.client()
        client.wait_for_dag("train_tinylm", timeout=180)
        client.unpause("train_tinylm")
        raw, dag, breakdown = [], [], []
        for i in range(args.rounds):
            raw.append(run_torchrun(spec, work))
            print(f"round {i}: torchrun+evaluate {raw[-1]:.1f}s", flush=True)
            dag.append(run_dag(client, "train_tinylm", conf, i, breakdown))
            print(f"round {i}: DAG via REST      {dag[-1]:.1f}s", flush=True)
    finally:
        stack.stop()
        shutil.rmtree(work, ignore_errors=True)
    side_by_side(
        "overhead",
        args.out,
        ("torchrun", raw),
        ("dag", dag),
        spec=conf,
        world_size=spec.world_size,
        rounds=args.rounds,
        dag_task_breakdown=breakdown,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
