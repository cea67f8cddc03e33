"""bench/detection: how fast a crashed or a hung rank is noticed, trainflow vs its baseline.

The same gang (digits, 2 ranks, gloo) and the same fault, alternating, in one run:

- crash (rank 1 SIGKILLed): trainflow's node agents vs raw ``torchrun --max-restarts``.
  Both notice through torch elastic's worker monitor; detection = the agent's
  "Worker group FAILED" log line − the kill.
- hang (rank 1 SIGSTOPped: alive, no progress): trainflow's heartbeat watch
  (``classify`` over the progress heartbeats, heartbeat interval 0.5 s, timeout 5 s,
  polled every 0.5 s as the triggerer does) vs the same gang under raw torchrun, whose only
  hang detector is torch.distributed's collective timeout (30 min by default for gloo;
  Airflow never sees a hang, the task process is alive). The baseline is watched for
  ``--window`` seconds (default 90, NVRx's default hang timeout) and reported as not
  detected if nothing happens in it.

    .venv/bin/python bench/detection.py [--rounds 3] [--window 90]
    .venv/bin/python bench/detection.py --smoke    # what the test suite runs

Writes bench/results/detection.json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from trainflow.heartbeat import HeartbeatPolicy, Verdict, classify, read_all  # noqa: E402
from trainflow.launch.local import prepare, start_agents, stop_agents  # noqa: E402
from trainflow.spec import TrainingSpec  # noqa: E402
from trainflow.workspace import write_json_atomic  # noqa: E402

SPEC = dict(
    workload="digits",
    nodes=2,
    nproc_per_node=1,
    steps=200_000,
    batch_size=16,
    checkpoint_interval=100,
    seed=1,
    heartbeat_interval=0.5,
    heartbeat_timeout=5.0,
)
_LOG_TIME = re.compile(r"^[IWE]\d{4} (\d\d):(\d\d):(\d\d\.\d+) .*Worker group FAILED", re.M)


def _failed_at(log: Path, after: float) -> float | None:
    """Epoch time of the first "Worker group FAILED" line after ``after`` (glog times are
    local time of day)."""
    day = time.mktime(time.localtime(after)[:3] + (0, 0, 0, 0, 0, -1))
    for m in _LOG_TIME.finditer(log.read_text(errors="replace")):
        t = day + int(m.group(1)) * 3600 + int(m.group(2)) * 60 + float(m.group(3))
        if t >= after:
            return t
    return None


def _start(kind: str, spec: TrainingSpec, run_dir: Path) -> tuple[list[subprocess.Popen], list[Path]]:
    if kind == "trainflow":
        procs = start_agents(prepare(spec, run_dir), spec.nodes, log_dir=run_dir / "logs")
        return procs, [run_dir / "logs" / f"agent-{n}.log" for n in range(spec.nodes)]
    for sub in ("checkpoints", "heartbeats", "logs"):
        (run_dir / sub).mkdir(parents=True, exist_ok=True)
    write_json_atomic(run_dir / "spec.json", spec.to_dict())
    env = {
        **os.environ,
        "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo"),
        "OMP_NUM_THREADS": "1",
        "LOGLEVEL": "INFO",
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
    }
    log = run_dir / "logs" / "torchrun.log"
    proc = subprocess.Popen(
        [
            str(Path(sys.executable).parent / "torchrun"),
            "--standalone",
            f"--nproc-per-node={spec.world_size}",
            "--max-restarts=3",  # torchrun's 0.1 s monitor
            "-m",
            "trainflow.worker.train",
            "--run-dir",
            str(run_dir),
        ],
        env=env,
        stdout=open(log, "ab"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    return [proc], [log]


def _wait_training(run_dir: Path, world: int, timeout: float = 120) -> dict[int, dict]:
    deadline = time.time() + timeout
    while time.time() < deadline:
        beats = read_all(run_dir / "heartbeats")
        if len(beats) == world and min(b["step"] for b in beats.values()) > 200:
            return beats
        time.sleep(0.1)
    raise RuntimeError(f"gang under {run_dir} did not start training in {timeout}s")


def measure(kind: str, fault: str, spec: TrainingSpec, run_dir: Path, window: float) -> float | None:
    """Seconds from the fault to its detection, or None if not detected in ``window``."""
    procs, logs = _start(kind, spec, run_dir)
    try:
        pid = int(_wait_training(run_dir, spec.world_size)[1]["pid"])
        t_fault = time.time()
        os.kill(pid, signal.SIGKILL if fault == "crash" else signal.SIGSTOP)
        policy = HeartbeatPolicy(timeout=spec.heartbeat_timeout, startup_timeout=spec.startup_timeout)
        deadline = t_fault + window
        while time.time() < deadline:
            if fault == "crash" or kind == "torchrun":
                found = [t for log in logs if (t := _failed_at(log, t_fault)) is not None]
                if found:
                    return min(found) - t_fault
            else:
                now = time.time()
                verdict = classify(
                    read_all(run_dir / "heartbeats"),
                    now=now,
                    world_size=spec.world_size,
                    started_at=t_fault - 60,
                    policy=policy,
                ).verdict
                if verdict == Verdict.STALLED:
                    return now - t_fault
            time.sleep(0.5 if fault == "hang" and kind == "trainflow" else 0.05)
        return None
    finally:
        stop_agents(procs)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--window", type=float, default=90.0)
    parser.add_argument("--out", type=Path, default=None, help="default bench/results/detection.json")
    parser.add_argument(
        "--smoke", action="store_true", help="one round, the baseline's hang watched 10 s (the suite runs it)"
    )
    args = parser.parse_args()
    if args.smoke:
        args.rounds, args.window = 1, 10.0
    args.out = args.out or REPO / "bench" / "results" / ("detection_smoke.json" if args.smoke else "detection.json")
    spec = TrainingSpec.from_mapping(SPEC)
    work = Path(tempfile.mkdtemp(prefix="tf-detection-"))
    out: dict = {"bench": "detection", "spec": SPEC, "window_s": args.window, "machine": {"cpus": os.cpu_count()}}
    for fault in ("crash", "hang"):
        series: dict[str, list] = {"torchrun": [], "trainflow": []}
        for i in range(args.rounds):
            for kind in ("torchrun", "trainflow"):
                if kind == "torchrun" and fault == "hang" and i > 0:
                    continue  # one window is enough to show the baseline does not notice
                t = measure(kind, fault, spec, work / f"{fault}-{kind}-{i}", args.window)
                series[kind].append(t)
                print(f"{fault} round {i}: {kind} {'not detected' if t is None else f'{t:.2f}s'}", flush=True)
        got = {k: [t for t in v if t is not None] for k, v in series.items()}
        out[fault] = {
            **{f"{k}_s": v for k, v in series.items()},
            **{f"{k}_median_s": statistics.median(v) if v else None for k, v in got.items()},
            "torchrun_detected": f"{len(got['torchrun'])}/{len(series['torchrun'])}",
        }
        base, ours = out[fault]["torchrun_median_s"], out[fault]["trainflow_median_s"]
        out[fault]["speedup"] = (base / ours) if base and ours else None
        if base is None and ours:
            out[fault]["speedup_at_least"] = args.window / ours
    out["time"] = time.time()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1))
    print(
        json.dumps({f: {k: v for k, v in out[f].items() if "median" in k or "speedup" in k} for f in ("crash", "hang")})
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
