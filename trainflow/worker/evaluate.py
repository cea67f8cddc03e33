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
    spec = TrainingSpec.from_json((run_dir / "spec.json").read_text())
    thash = spec.training_hash()
    if checkpoint:
        ref = manifest.verify(Path(checkpoint), training_hash=thash)
    else:
        ref = manifest.newest_verified(run_dir / "checkpoints", training_hash=thash)
    if ref is None:
        raise CheckpointError(f"no verified checkpoint to evaluate ({checkpoint or run_dir / 'checkpoints'})")
    if spec.program:
        return program_result(run_dir, ref)
    import torch

    from trainflow.checkpoint import dcp
    from trainflow.workloads import load_workload

    torch.set_num_threads(1)
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
        result["target"] = {"metric": name, "op": op, "value": value, "met": bool(_OPS[op](metrics[name], value))}
    return result


# Files whose bytes are not a function of their content alone (``torch.save`` writes a
# fresh serialization id into each): identified by the tensors and values they hold.
TORCH_FILES = (".pt", ".pth", ".ckpt", ".bin")


def _tree_digest(h, obj) -> None:
    """Feed ``obj`` (nested dicts, lists, tensors, numbers) into ``h`` in a fixed order."""
    import torch

    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    elif isinstance(obj, dict):
        h.update(b"{")
        for key in sorted(obj, key=repr):
            h.update(repr(key).encode())
            _tree_digest(h, obj[key])
        h.update(b"}")
    elif isinstance(obj, (list, tuple)):
        h.update(b"[")
        for item in obj:
            _tree_digest(h, item)
        h.update(b"]")
    else:
        h.update(repr(obj).encode())


def content_digest(path: Path, meta: dict) -> str:
    """A checkpoint file's identity: for PyTorch files, a digest of the tensors and values
    they hold (the same for two saves of equal state); for any other file its recorded
    digest."""
    import hashlib

    if path.suffix in TORCH_FILES:
        import torch

        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception:  # noqa: BLE001 - not a torch file after all: its bytes identify it
            return ":".join(manifest.entry_digest(meta))
        h = hashlib.sha256()
        _tree_digest(h, state)
        return "torch:" + h.hexdigest()
    return ":".join(manifest.entry_digest(meta))


def dcp_digest(path: Path) -> str:
    """The identity of a DCP checkpoint's state (its ``.metadata`` records the path it was
    written to, so its bytes differ between runs that saved equal state)."""
    import hashlib
    import tempfile

    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(str(path), str(Path(tmp) / "state.pt"))
        state = torch.load(Path(tmp) / "state.pt", map_location="cpu", weights_only=False)
    h = hashlib.sha256()
    _tree_digest(h, state)
    return "dcp:" + h.hexdigest()


def program_result(run_dir: Path, ref) -> dict:
    """What a user's program's run shows: the metrics it last reported (rank 0's), and the
    identity of its final checkpoint (``weights_sha256``): a digest over its files by path,
    each identified by its content (``content_digest``), so two runs that saved the same
    state compare equal."""
    import hashlib

    from trainflow.timeline import read_lines

    curve = read_lines(run_dir / "curve.jsonl")
    last = curve[-1] if curve else {}
    metrics = {k: v for k, v in (last.get("metrics") or {}).items() if isinstance(v, (int, float))}
    files = (manifest.read_manifest(Path(ref.path)) or {}).get("files", {})
    if ".metadata" in files:  # a DCP folder: its state, whatever the files' layout and paths
        identity = hashlib.sha256(dcp_digest(Path(ref.path)).encode())
    else:
        identity = hashlib.sha256(
            json.dumps(
                {rel: content_digest(Path(ref.path) / rel, meta) for rel, meta in sorted(files.items())}, sort_keys=True
            ).encode()
        )
    return {
        "program": True,
        "step": ref.step,
        "checkpoint": ref.path,
        "metrics": check_metrics({**metrics, "step": float(ref.step)}),
        "weights_sha256": identity.hexdigest(),
        "reported_step": last.get("step"),
    }


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
