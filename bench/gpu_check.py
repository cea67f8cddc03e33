"""bench/gpu_check: the digits workload on one NVIDIA GPU through the adapter layer, beside
the same run on the CPU, in one run.

Checks what only real hardware can: ``trainflow doctor`` detects the family and counts
the GPU through nvidia-smi; the worker gets its device from the visibility variable,
trains with the ``cuda:nccl,cpu:gloo`` composite backend and the AMP dtype the bf16 rule
picks (``precision: auto``); the run reaches the CPU run's accuracy; an interrupted GPU
run resumes from its newest verified checkpoint to the same weights as an uninterrupted
one. Exits 77 (skipped) with the reason on a host without an NVIDIA GPU.

    .venv/bin/python bench/gpu_check.py [--steps 600]

Writes bench/results/gpu_check.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SKIP = 77


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "gpu_check.json")
    args = parser.parse_args()

    from trainflow.chips.doctor import examine

    report = examine(explicit="nvidia")
    if not report["healthy"] or not report["devices"]:
        print(f"gpu_check: skipped, no healthy NVIDIA GPU here: {report['health']['detail']}", file=sys.stderr)
        return SKIP
    from trainflow.checkpoint import manifest
    from trainflow.launch.local import kill_tree, prepare, run_local, start_agents
    from trainflow.spec import TrainingSpec
    from trainflow.worker.evaluate import evaluate

    base = dict(
        workload="digits", nodes=1, nproc_per_node=1, steps=args.steps, batch_size=32, checkpoint_interval=50, seed=11
    )
    work = Path(tempfile.mkdtemp(prefix="tf-gpu-check-"))
    result: dict = {
        "bench": "gpu_check",
        "doctor": {k: report[k] for k in ("family", "devices", "queue", "evidence")},
        "device_list": report["device_list"],
        "steps": args.steps,
    }
    try:
        for name, extra in (("cpu", {"chip": "cpu"}), ("gpu", {"chip": "nvidia", "precision": "auto"})):
            spec = TrainingSpec.from_mapping({**base, **extra})
            t0 = time.perf_counter()
            codes = run_local(spec, work / name)
            wall = time.perf_counter() - t0
            if codes != [0]:
                log = "".join(p.read_text()[-3000:] for p in (work / name / "logs").glob("*.log"))
                raise SystemExit(f"gpu_check: the {name} run failed ({codes}):\n{log}")
            score = evaluate(work / name)
            result[name] = {
                "wall_s": round(wall, 2),
                "accuracy": score["metrics"].get("accuracy"),
                "weights_sha256": score["weights_sha256"],
            }
        logs = "".join(p.read_text() for p in (work / "gpu" / "logs").glob("*.log"))
        result["gpu"]["backend_seen"] = "cuda:nccl,cpu:gloo" in logs or "nccl" in logs.lower()
        # Interrupt a GPU run after its first checkpoint, resume it, compare the weights.
        spec = TrainingSpec.from_mapping({**base, "chip": "nvidia", "precision": "auto"})
        plan = prepare(spec, work / "resumed")
        procs = start_agents(plan, 1, log_dir=work / "resumed" / "logs")
        deadline = time.time() + 600
        try:
            while time.time() < deadline:
                ref = manifest.newest_verified(work / "resumed" / "checkpoints")
                if ref and ref.step >= 100:
                    break
                time.sleep(0.05)
        finally:
            for p in procs:
                kill_tree(p)
                p.wait()
        killed_at = manifest.newest_verified(work / "resumed" / "checkpoints").step
        assert run_local(spec, work / "resumed") == [0]
        resumed = evaluate(work / "resumed")
        result["resume"] = {
            "killed_at_step": killed_at,
            "bit_identical": resumed["weights_sha256"] == result["gpu"]["weights_sha256"],
        }
        result["ok"] = (
            result["resume"]["bit_identical"]
            and (result["gpu"]["accuracy"] or 0) >= (result["cpu"]["accuracy"] or 0) - 0.03
        )
        try:
            smi = subprocess.run(
                ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=30,
            ).stdout.strip()
            result["nvidia_smi"] = smi
        except OSError:
            pass
        result["time"] = time.time()
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
        print(json.dumps(result, indent=1))
        return 0 if result["ok"] else 1
    finally:
        if os.environ.get("TRAINFLOW_KEEP_BENCH") != "1":
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
