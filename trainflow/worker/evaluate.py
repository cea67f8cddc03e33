"""Score a run's checkpoint on held-out data (a subprocess of the evaluate task).

``python -m trainflow.worker.evaluate --run-dir DIR [--checkpoint PATH]`` loads the
checkpoint (only if its manifest verifies), evaluates the workload and writes
``metrics.json``: the workload's metrics, whether its target was met, and the SHA-256
of the weights (the bit-exact identity the tests compare).
"""

from __future__ import annotations

import argparse
import json
import operator
import sys
from pathlib import Path

from trainflow.bounds import check_metrics
from trainflow.checkpoint import manifest
from trainflow.errors import CheckpointError, WorkloadOutputError
from trainflow.spec import TrainingSpec
from trainflow.workspace import write_json_atomic

_OPS = {">=": operator.ge, "<=": operator.le}
# Exit code of a failure in the workload's own code (bad metrics): the task fails, no retry.
USER_ERROR_EXIT_CODE = 3


def evaluate(run_dir: Path, checkpoint: str | None = None) -> dict:
    """Evaluate the newest verified checkpoint of ``run_dir`` (or ``checkpoint``).

    Raises:
        CheckpointError: no checkpoint verifies.
    """
    import torch

    from trainflow.checkpoint import dcp
    from trainflow.workloads import load_workload

    torch.set_num_threads(1)
    spec = TrainingSpec.from_json((run_dir / "spec.json").read_text())
    thash = spec.training_hash()
    if checkpoint:
        ref = manifest.verify(Path(checkpoint), training_hash=thash)
    else:
        ref = manifest.newest_verified(run_dir / "checkpoints", training_hash=thash)
    if ref is None:
        raise CheckpointError(f"no verified checkpoint to evaluate ({checkpoint or run_dir / 'checkpoints'})")
    workload = load_workload(spec)
    dcp.load_model_only(workload.model, ref.path)
    metrics = check_metrics(workload.evaluate(workload.model))  # bounded: it goes to XCom and the page
    result = {
        "workload": spec.workload,
        "step": ref.step,
        "checkpoint": ref.path,
        "metrics": metrics,
        "weights_sha256": dcp.weights_digest(workload.model),
        "info": workload.info,
    }
    if workload.target:
        name, op, value = workload.target
        result["target"] = {"metric": name, "op": op, "value": value,
                            "met": bool(_OPS[op](metrics[name], value))}
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="evaluate a trainflow checkpoint")
    parser.add_argument("--run-dir", required=True, type=Path)
    parser.add_argument("--checkpoint")
    args = parser.parse_args(argv)
    from trainflow.launch.runas import drop_privileges

    drop_privileges()  # the tenant's own OS user, before its workload loads
    try:
        result = evaluate(args.run_dir, args.checkpoint)
    except WorkloadOutputError as exc:  # the workload's own fault: retrying cannot help
        print(f"evaluation failed in the workload: {exc}", file=sys.stderr, flush=True)
        return USER_ERROR_EXIT_CODE
    write_json_atomic(args.run_dir / "metrics.json", result)
    print(json.dumps(result, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
