"""bench/program_overhead: a user's Hugging Face program under raw torchrun and as a trainflow run.

The program is ``examples/hf_program.py`` (a tiny GPT-2 built from its config, trained by
``transformers.Trainer`` on bytes of the standard library, a checkpoint every
``--save-steps``), unchanged on both sides, 2 ranks × 1 thread on gloo:

- **throughput and wall**: ``torchrun --standalone --nproc-per-node 2 hf_program.py …``
  against the same argv as ``program`` of a ``train_digits`` DAG run triggered over REST on
  an embedded stack (trigger → success), alternating for ``--pairs`` rounds. Steady
  throughput is read from the program's own step clock (``--step-times``: rank 0 writes the
  time of every step), after ``--warmup`` steps, the same way on both sides. Goals: steady
  throughput ≥ 0.98× and wall ≤ 1.10× raw torchrun.
- **recovery**: rank 1 SIGKILLed once a checkpoint exists; kill → the program's first step
  after it, ``torchrun --max-restarts 3`` (which starts the program over) against
  trainflow's node agents without Airflow (which resume it from the newest verified
  checkpoint), alternating for ``--pairs`` rounds.

    .venv/bin/python bench/program_overhead.py                 # ~2-minute jobs, 3 pairs
    .venv/bin/python bench/program_overhead.py --smoke         # seconds: what the test suite runs

``--smoke`` runs every side once with a few steps, the DAG side on a stack of its own too
unless ``--no-dag``. Writes bench/results/program_overhead.json (``_smoke`` with --smoke).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from _results import embedded_stack, gang_env, torchrun  # noqa: E402

from trainflow.spec import TrainingSpec  # noqa: E402

EXAMPLE = REPO / "examples" / "hf_program.py"
DAG = "train_digits"


def program(steps: int, save_steps: int, times: Path, out: Path) -> list[str]:
    return ["python", str(EXAMPLE), "--steps", str(steps), "--save-steps", str(save_steps),
            "--step-times", str(times), "--out", str(out)]  # fmt: skip


def step_times(path: Path) -> list[tuple[float, int]]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        t, _, step = line.partition(" ")
        if step:
            rows.append((float(t), int(step)))
    return rows


def steady_rate(rows: list[tuple[float, int]], warmup: int) -> float:
    """Steps per second from the first step past ``warmup`` to the last (one uninterrupted run)."""
    steady = [(t, s) for t, s in rows if s > warmup]
    if len(steady) < 2:
        raise RuntimeError(f"too few steps past the warm-up ({len(steady)}); raise --steps")
    (t0, s0), (t1, s1) = steady[0], steady[-1]
    return (s1 - s0) / (t1 - t0)


def run_raw(steps: int, save_steps: int, warmup: int, work: Path) -> dict:
    work.mkdir(parents=True)
    times = work / "steps.txt"
    argv = program(steps, save_steps, times, work / "out")
    t0 = time.perf_counter()
    subprocess.run([*torchrun(), *argv[1:]], env=gang_env(), check=True, capture_output=True, cwd=work)
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "steps_per_s": steady_rate(step_times(times), warmup)}


def run_dag(client, steps: int, save_steps: int, warmup: int, work: Path, i: int) -> dict:
    work.mkdir(parents=True)
    times = work / "steps.txt"
    conf = {"tenant": "bench", "steps": steps, "checkpoint_interval": save_steps, "keep_last": 2,
            "heartbeat_timeout": 120.0, "program": program(steps, save_steps, times, work / "out")}  # fmt: skip
    t0 = time.perf_counter()
    run_id = client.trigger(DAG, conf, run_id=f"progbench-{int(time.time())}-{i}")["dag_run_id"]
    run = client.wait_run(DAG, run_id, timeout=3600, poll=0.5)
    wall = time.perf_counter() - t0
    if run["state"] != "success":
        raise RuntimeError(f"DAG run {run_id} ended {run['state']}")
    return {"wall_s": wall, "steps_per_s": steady_rate(step_times(times), warmup)}


def _rank_pid(root: int, rank: int) -> int | None:
    """The pid of the program's process with ``RANK=rank`` below ``root``."""
    import psutil

    for child in psutil.Process(root).children(recursive=True):
        try:
            if child.environ().get("RANK") == str(rank) and "hf_program.py" in " ".join(child.cmdline()):
                return child.pid
        except psutil.Error:
            continue
    return None


def _kill_and_time(roots: list[int], times: Path, kill_after: int, deadline: float) -> float:
    """SIGKILL rank 1 once the program passed ``kill_after`` steps; return the seconds from the
    kill to the first step written after it."""
    while time.time() < deadline:
        rows = step_times(times)
        if rows and rows[-1][1] > kill_after:
            pid = next((p for r in roots if (p := _rank_pid(r, 1)) is not None), None)
            if pid is not None:
                seen = len(rows)
                killed = time.time()
                os.kill(pid, signal.SIGKILL)
                while time.time() < deadline:
                    after = [t for t, _ in step_times(times)[seen:] if t > killed]
                    if after:
                        return after[0] - killed
                    time.sleep(0.01)
        time.sleep(0.02)
    raise RuntimeError(f"no step after the kill before the deadline ({times})")


def recovery_raw(steps: int, save_steps: int, work: Path) -> float:
    work.mkdir(parents=True)
    times = work / "steps.txt"
    argv = program(steps, save_steps, times, work / "out")
    # With the rendezvous store shared with the workers (torch's default), a restarted gang's
    # init_process_group hangs on this torch: the store keeps the dead gang's addresses.
    # trainflow's agents set the same switch.
    proc = subprocess.Popen(
        [*torchrun("--max-restarts=3"), *argv[1:]],
        env=gang_env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1"),
        cwd=work,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        return _kill_and_time([proc.pid], times, save_steps + 5, time.time() + 900)
    finally:
        proc.kill()
        subprocess.run(["pkill", "-9", "-f", str(times)], check=False)


def recovery_trainflow(steps: int, save_steps: int, work: Path) -> float:
    from trainflow.launch.local import prepare, start_agents, stop_agents

    times = work / "steps.txt"
    spec = TrainingSpec(nodes=2, steps=steps, checkpoint_interval=save_steps, keep_last=2, heartbeat_interval=0.5,
                        heartbeat_timeout=120.0, program=program(steps, save_steps, times, work / "out"))  # fmt: skip
    procs = start_agents(prepare(spec, work / "run"), spec.nodes, log_dir=work / "run" / "logs")
    try:
        return _kill_and_time([p.pid for p in procs], times, save_steps + 5, time.time() + 900)
    finally:
        stop_agents(procs)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=2000, help="steps per job (~2 minutes on 2 cores)")
    parser.add_argument("--save-steps", type=int, default=250)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--no-dag", action="store_true", help="leave out the DAG side (no Airflow stack)")
    parser.add_argument("--smoke", action="store_true", help="seconds: every side once, a few steps")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.smoke:
        args.pairs, args.steps, args.save_steps, args.warmup = 1, 60, 20, 10
    out = args.out or REPO / "bench" / "results" / (
        "program_overhead_smoke.json" if args.smoke else "program_overhead.json"
    )
    work = Path(tempfile.mkdtemp(prefix="tf-progbench-"))
    raw, dag, rec_raw, rec_tf = [], [], [], []
    try:
        for i in range(args.pairs):
            rec_raw.append(recovery_raw(args.steps, args.save_steps, work / f"rec-raw-{i}"))
            rec_tf.append(recovery_trainflow(args.steps, args.save_steps, work / f"rec-tf-{i}"))
            print(
                json.dumps({"pair": i, "recovery_raw_s": rec_raw[-1], "recovery_trainflow_s": rec_tf[-1]}), flush=True
            )
        if args.no_dag:
            for i in range(args.pairs):
                raw.append(run_raw(args.steps, args.save_steps, args.warmup, work / f"raw-{i}"))
        else:
            env = {"TRAINFLOW_PROGRAM_ROOTS": str(EXAMPLE.parent)}
            with embedded_stack("tf-progbench-stack-", extra_env=env) as stack:
                client = stack.client()
                client.wait_for_dag(DAG, timeout=300)
                client.unpause(DAG)
                for i in range(args.pairs):
                    raw.append(run_raw(args.steps, args.save_steps, args.warmup, work / f"raw-{i}"))
                    dag.append(run_dag(client, args.steps, args.save_steps, args.warmup, work / f"dag-{i}", i))
                    print(json.dumps({"pair": i, "raw": raw[-1], "dag": dag[-1]}), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    def median(rows, key):
        return statistics.median(r[key] for r in rows) if rows else None

    result = {
        "bench": "program_overhead",
        "program": "examples/hf_program.py",
        "steps": args.steps,
        "save_steps": args.save_steps,
        "pairs": args.pairs,
        "raw": raw,
        "dag": dag,
        "recovery_raw_s": rec_raw,
        "recovery_trainflow_s": rec_tf,
        "recovery_raw_median_s": statistics.median(rec_raw),
        "recovery_trainflow_median_s": statistics.median(rec_tf),
        "recovery_ratio": statistics.median(rec_tf) / statistics.median(rec_raw),
        "machine": {"cpus": os.cpu_count()},
        "time": time.time(),
    }
    if dag:
        result["throughput_ratio"] = median(dag, "steps_per_s") / median(raw, "steps_per_s")
        result["wall_ratio"] = median(dag, "wall_s") / median(raw, "wall_s")
        result["pair_throughput_ratios"] = [d["steps_per_s"] / r["steps_per_s"] for r, d in zip(raw, dag)]
        result["pair_wall_ratios"] = [d["wall_s"] / r["wall_s"] for r, d in zip(raw, dag)]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k.endswith("ratio") or k.endswith("median_s")}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
