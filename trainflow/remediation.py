"""Acting on heartbeat verdicts: node replacement requests and the run's abort record.

The heartbeat watch (in the triggerer) decides; it asks a node's shard_train task to
kill its agent and fail, so Airflow's retry replaces the node. The request is a small
file in the run's workspace that the task polls (embedded profile).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from trainflow.heartbeat import Classification, read_all
from trainflow.timeline import record
from trainflow.workspace import write_json_atomic


def aborted(run_dir: Path) -> dict | None:
    """The run's abort record (a non-retryable failure: user code, crash loop ...), if any."""
    try:
        return json.loads((Path(run_dir) / "ABORT").read_text())
    except (OSError, ValueError):
        return None


def abort(run_dir: Path, error: dict) -> bool:
    """Write the run's abort record (first writer wins); True if this call wrote it.

    ``error`` names who stopped the run (``rank``, or ``node`` for a failure before any
    worker started), the ``kind`` and the ``message``.
    """
    path = Path(run_dir) / "ABORT"
    if path.exists():
        return False
    write_json_atomic(path, error)
    return True


def abort_source(error: dict) -> str:
    """Who stopped the run, for messages: ``rank 3`` or ``node 1``."""
    return f"rank {error['rank']}" if error.get("rank") is not None else f"node {error.get('node')}"


def remediations(run_dir: Path) -> int:
    """Node replacements requested so far (pending and handled)."""
    control = Path(run_dir) / "control"
    return len(list(control.glob("restart-node-*"))) if control.is_dir() else 0


def _request(run_dir: Path, node: int, payload: dict) -> None:
    control = Path(run_dir) / "control"
    control.mkdir(parents=True, exist_ok=True)
    pending = control / f"restart-node-{node:04d}.json"
    if pending.exists():
        # The node's task never took the last request (it is gone for good, e.g. its retries
        # are spent): keep it, so it still counts against the watch's budget.
        n = len(list(control.glob(f"{pending.name}.unanswered-*")))
        os.replace(pending, pending.with_name(f"{pending.name}.unanswered-{n}"))
    write_json_atomic(pending, payload)


def request_node_restart(run_dir: Path, result: Classification, now: float) -> list[int]:
    """Ask the nodes of the stalled ranks to restart; returns the node indices."""
    beats = read_all(Path(run_dir) / "heartbeats")
    nodes = sorted({int(beats[r]["node"]) for r in result.ranks if r in beats})
    for node in nodes:
        _request(run_dir, node, {"time": now, "reason": result.message, "ranks": list(result.ranks)})
    record(run_dir, "stall_detected", verdict=result.verdict.value, ranks=list(result.ranks),
           nodes=nodes, steps={str(k): v for k, v in result.steps.items()}, message=result.message)
    return nodes


def exclude_straggler(run_dir: Path, straggler: dict, *, checkpoint_step: int, now: float) -> int:
    """Replace the straggler's node and cordon its host (the node task does the cordon).

    Called once a checkpoint newer than the straggler's confirmation has committed, so
    the replacement resumes from it and loses only the restart time.
    """
    node = int(straggler["node"])
    reason = (f"straggler: rank {straggler['rank']} computes {straggler['compute_ms']} ms/step, "
              f"{100 * straggler['slower_by']:.0f}% slower than its peers' median "
              f"{straggler['median_ms']} ms")
    _request(run_dir, node, {"time": now, "reason": reason, "ranks": [straggler["rank"]], "cordon": True})
    step = read_all(Path(run_dir) / "heartbeats").get(straggler["rank"], {}).get("step")
    record(run_dir, "straggler_excluded", node=node, rank=straggler["rank"], step=step,
           checkpoint_step=checkpoint_step, message=reason)
    return node
