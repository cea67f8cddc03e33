"""bench/gpu_check: the digits workload on one NVIDIA GPU through the adapter layer, beside
the same run on the CPU, in one run.

Checks what only real hardware can: ``trainflow doctor`` detects the family and counts
the GPU through nvidia-smi; the worker gets its device from the visibility variable,
trains with the ``cuda:nccl,cpu:gloo`` composite backend and the AMP dtype the bf16 rule
picks (``precision: auto``); the run reaches the CPU run's accuracy; an interrupted GPU
run resumes from its newest verified checkpoint to the same weights as an uninterrupted
one. Exits 77 (skipped) with the reason on a host without an NVIDIA GPU.

``--smoke`` runs the same checks with 200 steps and a checkpoint every 20: on the GPU where
there is a healthy one, else the GPU side on the CPU (``chip: cpu``, gloo), so the script
keeps running on hosts without a GPU; the result's ``device`` says which. Its figures are
not a measurement.

    .venv/bin/python bench/gpu_check.py [--steps 600]
    .venv/bin/python bench/gpu_check.py --smoke    # what the test suite runs

Writes bench/results/gpu_check.json (gpu_check_smoke.json with ``--smoke``).
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
    parser.add_argument("--steps", type=int, default=None, help="default 600; 200 with --smoke")
    parser.add_argument("--out", type=Path, default=None, help="default bench/results/gpu_check.json")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="seconds: 200 steps, a checkpoint every 20; the GPU side on the CPU (gloo) where there is "
        "no GPU (the suite runs it)",
    )
    args = parser.parse_args()
    args.steps = args.steps or (200 if args.smoke else 600)
    args.out = args.out or REPO / "bench" / "results" / ("gpu_check_smoke.json" if args.smoke else "gpu_check.json")

    from trainflow.chips.doctor import examine

    report = examine(explicit="nvidia")
    gpu = bool(report["healthy"] and report["devices"])
    if not gpu and not args.smoke:
        print(f"gpu_check: skipped, no healthy NVIDIA GPU here: {report['health']['detail']}", file=sys.stderr)
        return SKIP
    # The GPU side's chip: the GPU, or (a smoke on a host without one) the CPU, through the same code.
    chip = "nvidia" if gpu else "cpu"
    if not gpu:
        print(
            f"gpu_check --smoke: no healthy NVIDIA GPU here ({report['health']['detail']}); "
            "the GPU side runs on the CPU (gloo)",
            file=sys.stderr,
        )
    from trainflow.checkpoint import manifest
    from trainflow.launch.local import kill_tree, prepare, run_local, start_agents
    from trainflow.spec import TrainingSpec
    from trainflow.worker.evaluate import evaluate

    base = dict(
        workload="digits",
        nodes=1,
        nproc_per_node=1,
        steps=args.steps,
        batch_size=32,
        checkpoint_interval=20 if args.smoke else 50,
        seed=11,
    )
    work = Path(tempfile.mkdtemp(prefix="tf-gpu-check-"))
    result: dict = {
        "bench": "gpu_check",
        "doctor": {k: report[k] for k in ("family", "devices", "queue", "evidence")},
        "device_list": report["device_list"],
        "steps": args.steps,
        "smoke": args.smoke,
        "device": "cuda" if gpu else "cpu",
    }
    print(f"gpu_check: the GPU side runs on {result['device']}", flush=True)
    try:
        for name, extra in (("cpu", {"chip": "cpu"}), ("gpu", {"chip": chip, "precision": "auto"})):
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
        # NCCL shows in the GPU worker's log; the CPU worker's log names no backend (not known).
        result["gpu"]["backend_seen"] = ("cuda:nccl,cpu:gloo" in logs or "nccl" in logs.lower()) if gpu else None
        # Interrupt a GPU run once it has a verified checkpoint of step 2 × checkpoint_interval or
        # later, resume it, compare the weights with the uninterrupted run's.
        spec = TrainingSpec.from_mapping({**base, "chip": chip, "precision": "auto"})
        plan = prepare(spec, work / "resumed")
        procs = start_agents(plan, 1, log_dir=work / "resumed" / "logs")
        deadline = time.time() + 600
        try:
            while time.time() < deadline:
                ref = manifest.newest_verified(work / "resumed" / "checkpoints")
                if ref and ref.step >= 2 * base["checkpoint_interval"]:
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
