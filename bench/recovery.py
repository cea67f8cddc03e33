"""bench/recovery: fault → first new training step, trainflow vs raw torchrun.

Both run the same worker, the same spec (digits, 2 ranks, gloo) and the same injected
fault (rank 1 SIGKILLed at the same step), alternating, in one run:
  - baseline: ``torchrun --standalone --nproc-per-node=2 --max-restarts=3``
  - trainflow: two node agents (2 nodes × 1 rank), as shard_train runs them.
Recovery = time of the first training step after the restart − time of the kill (both
from the run's timeline). Goal: trainflow ≤ 1.2 × torchrun.

Each recovery is also split into stages, from the timeline and the agents' timestamped
logs (torch elastic at INFO, both sides), so the result says where the time goes; the
launcher's share (kill → new workers started) is summed apart from the worker's own start,
which is the same code on both sides and, on a shared CPU, most of the noise.

    .venv/bin/python bench/recovery.py [--rounds 3]
    .venv/bin/python bench/recovery.py --smoke    # seconds: what the test suite runs
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from _results import side_by_side  # noqa: E402

from trainflow import timeline  # noqa: E402
from trainflow.launch.agent import MONITOR_INTERVAL_S  # noqa: E402
from trainflow.launch.local import run_local  # noqa: E402
from trainflow.spec import TrainingSpec  # noqa: E402
from trainflow.workspace import write_json_atomic  # noqa: E402

SPEC = dict(
    workload="digits",
    nodes=2,
    nproc_per_node=1,
    steps=600,
    batch_size=16,
    checkpoint_interval=50,
    seed=1,
    faults=[{"kind": "kill_rank", "rank": 1, "step": 300}],
)

# Consecutive stages of one recovery; each ends at the named moment, the first starts at the kill.
STAGES = (
    ("detect", "the dead rank's agent sees its worker fail"),
    ("peer_notice", "the last agent stops its workers (torchrun: same agent, 0)"),
    ("rendezvous", "the new round is complete on every agent"),
    ("spawn", "the last agent has started its workers"),
    (
        "worker_init",
        "rank 0 has its process group, workload and resume point (python, import torch, "
        "init_process_group, build, DDP)",
    ),
    ("checkpoint_load", "rank 0 has loaded the checkpoint"),
    ("first_step", "rank 0 has trained its first new step"),
)

# torch elastic's agent messages (torch 2.13), glog-style prefix "I1202 15:26:18.501000 PID file:line]".
_LOG_LINE = re.compile(r"^[IWE](\d{4}) (\d\d:\d\d:\d\d\.\d+) \d+ \S+\] (.*)$")
_NOTICE = re.compile(r"Worker group (FAILED|UNHEALTHY)|Detected \d+ new nodes")


def agent_events(log: Path, year: int) -> list[tuple[float, str]]:
    """(epoch time, message) of every torch elastic line in an agent's log (local-time stamps)."""
    out = []
    for line in log.read_text(errors="replace").splitlines():
        if m := _LOG_LINE.match(line):
            stamp = datetime.strptime(f"{year}{m[1]} {m[2]}", "%Y%m%d %H:%M:%S.%f")
            out.append((stamp.timestamp(), m[3]))
    return out


def breakdown(run_dir: Path, agent_logs: list[Path]) -> dict[str, float]:
    """Seconds spent in each of ``STAGES`` for the run's first fault (they add up to the recovery)."""
    events = timeline.read(run_dir)
    fault = next(e["time"] for e in events if e["event"] == "fault_injected")
    first = next(e["time"] for e in events if e["event"] == "first_step" and e["time"] > fault)

    def last(name: str) -> float:
        return max(e["time"] for e in events if e["event"] == name and fault < e["time"] <= first)

    year = time.localtime(fault).tm_year
    logs = [[(t, msg) for t, msg in agent_events(p, year) if fault <= t <= first] for p in agent_logs]
    notices = [min(t for t, msg in log if _NOTICE.search(msg)) for log in logs]
    moments = [
        min(notices),
        max(notices),
        max(max(t for t, msg in log if "] Rendezvous complete" in msg) for log in logs),
        max(max(t for t, msg in log if "] Starting worker group" in msg) for log in logs),
        last("gang_start"),
        last("resumed"),
        first,
    ]
    ends = dict(zip((name for name, _ in STAGES), moments))
    prev, out = fault, {}
    for name, _ in STAGES:
        out[name] = ends[name] - prev
        prev = ends[name]
    return out


def recovery_s(run_dir: Path) -> float:
    events = timeline.read(run_dir)
    fault = next(e for e in events if e["event"] == "fault_injected")
    first = next(e for e in events if e["event"] == "first_step" and e["time"] > fault["time"])
    return first["time"] - fault["time"]


def run_torchrun(spec: TrainingSpec, run_dir: Path) -> tuple[float, dict[str, float]]:
    for sub in ("checkpoints", "heartbeats", "logs"):
        (run_dir / sub).mkdir(parents=True)
    write_json_atomic(run_dir / "spec.json", spec.to_dict())
    env = {
        **os.environ,
        "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo"),
        "OMP_NUM_THREADS": "1",
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
        "LOGLEVEL": "INFO",
    }
    log = run_dir / "logs" / "torchrun.log"
    with open(log, "wb") as out:
        subprocess.run(
            [
                str(Path(sys.executable).parent / "torchrun"),
                "--standalone",
                f"--nproc-per-node={spec.world_size}",
                "--max-restarts=3",
                f"--monitor-interval={MONITOR_INTERVAL_S}",
                "-m",
                "trainflow.worker.train",
                "--run-dir",
                str(run_dir),
            ],
            env=env,
            check=True,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    return recovery_s(run_dir), breakdown(run_dir, [log])


def run_trainflow(spec: TrainingSpec, run_dir: Path) -> tuple[float, dict[str, float]]:
    codes = run_local(spec, run_dir)
    if codes != [0] * spec.nodes:
        raise RuntimeError(f"agents exited {codes}")
    logs = [run_dir / "logs" / f"agent-{node}.log" for node in range(spec.nodes)]
    return recovery_s(run_dir), breakdown(run_dir, logs)


# The stages the launcher decides (the kill until the new workers are started); the rest is
# the same worker code on both sides.
LAUNCHER_STAGES = ("detect", "peer_notice", "rendezvous", "spawn")


def median_stages(rows: list[dict[str, float]]) -> dict[str, float]:
    return {name: round(statistics.median(r[name] for r in rows), 3) for name, _ in STAGES}


def launcher_s(rows: list[dict[str, float]]) -> list[float]:
    return [sum(r[name] for name in LAUNCHER_STAGES) for r in rows]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None, help="default bench/results/recovery.json")
    parser.add_argument(
        "--smoke", action="store_true", help="seconds: one round, 120 steps, the kill at step 60 (the suite runs it)"
    )
    args = parser.parse_args()
    conf = dict(SPEC)
    if args.smoke:
        args.rounds = 1
        conf.update(steps=120, faults=[{"kind": "kill_rank", "rank": 1, "step": 60}])
    args.out = args.out or REPO / "bench" / "results" / ("recovery_smoke.json" if args.smoke else "recovery.json")
    spec = TrainingSpec.from_mapping(conf)
    work = Path(tempfile.mkdtemp(prefix="tf-recovery-"))
    raw, ours, raw_stages, our_stages = [], [], [], []
    for i in range(args.rounds):
        for runner, times, stages, name in (
            (run_torchrun, raw, raw_stages, "torchrun"),
            (run_trainflow, ours, our_stages, "trainflow"),
        ):
            seconds, parts = runner(spec, work / f"{name}-{i}")
            times.append(seconds)
            stages.append(parts)
            print(
                f"round {i}: {name:9s} {seconds:5.2f}s  " + "  ".join(f"{k} {v:.2f}" for k, v in parts.items()),
                flush=True,
            )
    side_by_side(
        "recovery",
        args.out,
        ("torchrun", raw),
        ("trainflow", ours),
        spec=conf,
        monitor_interval_s=MONITOR_INTERVAL_S,
        stages={name: what for name, what in STAGES},
        torchrun_stages=raw_stages,
        trainflow_stages=our_stages,
        torchrun_stages_median_s=median_stages(raw_stages),
        trainflow_stages_median_s=median_stages(our_stages),
        launcher_stages=LAUNCHER_STAGES,
        torchrun_launcher_median_s=statistics.median(launcher_s(raw_stages)),
        trainflow_launcher_median_s=statistics.median(launcher_s(our_stages)),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
