"""bench/throughput: trainflow's built-in loop against the plain DDP script a user would write.

Three sides, the same model, data, batch, optimizer and world size (2 ranks × 1 thread):

- ``plain``: ``bench/plain_ddp.py`` under ``torchrun`` (default bucketed DDP or FSDP2,
  ``DistributedSampler`` + ``DataLoader``, AdamW) — the baseline;
- ``worker``: trainflow's worker (``python -m trainflow.worker.train``) under ``torchrun``,
  one checkpoint at the end;
- ``dag`` (``--dag``): the same run as a DAG triggered over REST on an embedded stack.

Steady training throughput (steps/s after ``--warmup`` steps) of each side, alternating
(plain, worker[, dag], plain, worker …) for ``--pairs`` rounds, medians and the ratio to
plain. ``--profile`` adds where the worker's per-step time goes (``torch.profiler`` over
20 steady steps of rank 0, top operators by self CPU time).

    .venv/bin/python bench/throughput.py                  # digits and tinylm, ddp and fsdp
    .venv/bin/python bench/throughput.py --dag --profile
    .venv/bin/python bench/throughput.py --smoke          # seconds: what the test suite runs

Writes bench/results/throughput.json (throughput_smoke.json with --smoke).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from _results import gang_env, torchrun  # noqa: E402

from trainflow.spec import TrainingSpec  # noqa: E402
from trainflow.workspace import write_json_atomic  # noqa: E402

LR = {"digits": 0.003, "tinylm": 0.004}
BATCH = 16


def _env() -> dict[str, str]:
    return gang_env(PYTHONPATH=str(REPO))


def run_plain(workload: str, strategy: str, steps: int, warmup: int) -> float:
    out = subprocess.run(
        [
            *torchrun(),
            str(REPO / "bench" / "plain_ddp.py"),
            "--workload",
            workload,
            "--strategy",
            strategy,
            "--steps",
            str(steps),
            "--warmup",
            str(warmup),
            "--batch-size",
            str(BATCH),
            "--lr",
            str(LR[workload]),
        ],
        env=_env(),
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    line = next(x for x in out.splitlines() if x.startswith("{"))
    return float(json.loads(line)["steps_per_s"])


def steady_rate(curve: list[dict], warmup: int) -> float:
    """Steps/s between the first curve point at or past ``warmup`` and the last one."""
    points = [c for c in curve if c["step"] >= warmup]
    if len(points) < 2 or points[-1]["time"] <= points[0]["time"]:
        raise RuntimeError(f"too few loss-curve points past step {warmup} to measure: {points}")
    return (points[-1]["step"] - points[0]["step"]) / (points[-1]["time"] - points[0]["time"])


def spec_for(workload: str, strategy: str, steps: int) -> TrainingSpec:
    # One heartbeat (and curve point) every 0.25 s: enough points to time the steady part.
    return TrainingSpec(
        workload=workload,
        strategy=strategy,
        nodes=2,
        steps=steps,
        batch_size=BATCH,
        lr=LR[workload],
        checkpoint_interval=steps,
        heartbeat_interval=0.25,
        heartbeat_timeout=120.0,
    )


def run_worker(workload: str, strategy: str, steps: int, warmup: int, work: Path, profile: Path | None = None) -> float:
    from trainflow.timeline import read_lines

    run_dir = work / f"worker-{time.time_ns()}"
    run_dir.mkdir(parents=True)
    write_json_atomic(run_dir / "spec.json", spec_for(workload, strategy, steps).to_dict())
    env = _env()
    if profile is not None:
        env["TRAINFLOW_STEP_PROFILE"] = str(profile)
    subprocess.run(
        [*torchrun(), "-m", "trainflow.worker.train", "--run-dir", str(run_dir)],
        env=env,
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    rate = steady_rate(read_lines(run_dir / "curve.jsonl"), warmup)
    shutil.rmtree(run_dir)
    return rate


def run_dag(client, workload: str, strategy: str, steps: int, warmup: int, i: int) -> float:
    from trainflow.timeline import read_lines

    dag_id = f"train_{workload}"
    conf = {**spec_for(workload, strategy, steps).to_dict(), "faults": []}
    run_id = client.trigger(dag_id, conf, run_id=f"throughput-{workload}-{strategy}-{i}-{time.time_ns()}")["dag_run_id"]
    run = client.wait_run(dag_id, run_id, timeout=1800, poll=0.5)
    if run["state"] != "success":
        raise RuntimeError(f"DAG run {run_id} ended {run['state']}")
    run_dir = Path(client.xcom(dag_id, run_id, "provision", "run_dir"))
    return steady_rate(read_lines(run_dir / "curve.jsonl"), warmup)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="digits,tinylm")
    parser.add_argument("--strategies", default="ddp,fsdp")
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--dag", action="store_true", help="also the run as a DAG over REST (an embedded stack)")
    parser.add_argument("--profile", action="store_true", help="where the worker's step time goes (torch.profiler)")
    parser.add_argument("--smoke", action="store_true", help="seconds: digits/ddp, 1 pair, 60 steps")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.smoke:
        args.workloads, args.strategies, args.pairs, args.steps, args.warmup = "digits", "ddp", 1, 60, 10
    out = args.out or REPO / "bench" / "results" / ("throughput_smoke.json" if args.smoke else "throughput.json")
    work = Path(tempfile.mkdtemp(prefix="tf-throughput-"))
    cases = [(w, s) for w in args.workloads.split(",") for s in args.strategies.split(",")]
    result: dict = {
        "bench": "throughput",
        "smoke": args.smoke,
        "steps": args.steps,
        "warmup": args.warmup,
        "pairs": args.pairs,
        "world": 2,
        "batch_size": BATCH,
        "machine": {"cpus": os.cpu_count()},
        "cases": {},
    }
    stack_cm = None
    client = None
    try:
        if args.dag:
            from _results import embedded_stack

            stack_cm = embedded_stack("tf-throughput-stack-")
            stack = stack_cm.__enter__()
            client = stack.client()
            for w in {w for w, _ in cases}:
                client.wait_for_dag(f"train_{w}", timeout=180)
                client.unpause(f"train_{w}")
        for workload, strategy in cases:
            sides: dict[str, list[float]] = {"plain": [], "worker": [], **({"dag": []} if args.dag else {})}
            for i in range(args.pairs):
                sides["plain"].append(run_plain(workload, strategy, args.steps, args.warmup))
                sides["worker"].append(run_worker(workload, strategy, args.steps, args.warmup, work))
                if args.dag:
                    sides["dag"].append(run_dag(client, workload, strategy, args.steps, args.warmup, i))
                print(
                    f"{workload}/{strategy} pair {i}: "
                    + ", ".join(f"{k} {v[-1]:.2f}" for k, v in sides.items())
                    + " steps/s",
                    flush=True,
                )
            case = {f"{k}_steps_per_s": v for k, v in sides.items()}
            base = statistics.median(sides["plain"])
            for k in sides:
                case[f"{k}_median"] = statistics.median(sides[k])
                if k != "plain":
                    case[f"{k}_ratio"] = round(statistics.median(sides[k]) / base, 3)
                    case[f"{k}_paired_ratio"] = round(
                        statistics.median(s / p for s, p in zip(sides[k], sides["plain"])), 3
                    )
            if args.profile:
                table = work / f"profile-{workload}-{strategy}.txt"
                run_worker(workload, strategy, args.steps, args.warmup, work, profile=table)
                case["worker_profile_top"] = table.read_text().splitlines()[:30] if table.exists() else None
            result["cases"][f"{workload}/{strategy}"] = case
            print(json.dumps({f"{workload}/{strategy}": {k: v for k, v in case.items() if "ratio" in k}}), flush=True)
    finally:
        if stack_cm is not None:
            stack_cm.__exit__(None, None, None)
        shutil.rmtree(work, ignore_errors=True)
    result["time"] = time.time()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
