"""bench/recovery: fault → first new training step, trainflow vs raw torchrun.

Both run the same worker, the same spec (digits, 2 ranks, gloo) and the same injected
fault (rank 1 SIGKILLed at the same step), alternating, in one run:
  - baseline: ``torchrun --standalone --nproc-per-node=2 --max-restarts=3``
  - trainflow: two node agents (2 nodes × 1 rank), as shard_train runs them.
Recovery = time of the first training step after the restart − time of the kill (both
from the run's timeline). Goal: trainflow ≤ 1.2 × torchrun.

    .venv/bin/python bench/recovery.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from _results import side_by_side  # noqa: E402
from trainflow import timeline  # noqa: E402
from trainflow.launch.local import run_local  # noqa: E402
from trainflow.spec import TrainingSpec  # noqa: E402
from trainflow.workspace import write_json_atomic  # noqa: E402

SPEC = dict(workload="digits", nodes=2, nproc_per_node=1, steps=600, batch_size=16,
            checkpoint_interval=50, seed=1, faults=[{"kind": "kill_rank", "rank": 1, "step": 300}])


def recovery_s(run_dir: Path) -> float:
    events = timeline.read(run_dir)
    fault = next(e for e in events if e["event"] == "fault_injected")
    first = next(e for e in events if e["event"] == "first_step" and e["time"] > fault["time"])
    return first["time"] - fault["time"]


def run_torchrun(spec: TrainingSpec, run_dir: Path) -> float:
    for sub in ("checkpoints", "heartbeats"):
        (run_dir / sub).mkdir(parents=True)
    write_json_atomic(run_dir / "spec.json", spec.to_dict())
    env = {**os.environ, "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo"),
           "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    subprocess.run([str(Path(sys.executable).parent / "torchrun"), "--standalone",
                    f"--nproc-per-node={spec.world_size}", "--max-restarts=3", "--monitor-interval=0.2",
                    "-m", "trainflow.worker.train", "--run-dir", str(run_dir)],
                   env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return recovery_s(run_dir)


def run_trainflow(spec: TrainingSpec, run_dir: Path) -> float:
    codes = run_local(spec, run_dir)
    if codes != [0] * spec.nodes:
        raise RuntimeError(f"agents exited {codes}")
    return recovery_s(run_dir)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "recovery.json")
    args = parser.parse_args()
    spec = TrainingSpec.from_mapping(SPEC)
    work = Path(tempfile.mkdtemp(prefix="tf-recovery-"))
    raw, ours = [], []
    for i in range(args.rounds):
        raw.append(run_torchrun(spec, work / f"torchrun-{i}"))
        ours.append(run_trainflow(spec, work / f"trainflow-{i}"))
        print(f"round {i}: torchrun {raw[-1]:.2f}s  trainflow {ours[-1]:.2f}s", flush=True)
    side_by_side("recovery", args.out, ("torchrun", raw), ("trainflow", ours), spec=SPEC)
    return 0


if __name__ == "__main__":
    sys.exit(main())
