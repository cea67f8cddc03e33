"""Acting on heartbeat verdicts: node replacement requests and the run's abort record.

The heartbeat watch (in the triggerer) decides; it asks a node's shard_train task to
kill its agent and fail, so Airflow's retry replaces the node. The request is a small
file in the run's workspace that the task polls (embedded profile).
"""

from __future__ import annotations

import json
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


def remediations(run_dir: Path) -> int:
    """Node replacements requested so far (pending and handled)."""
    control = Path(run_dir) / "control"
    return len(list(control.glob("restart-node-*"))) if control.is_dir() else 0


def request_node_restart(run_dir: Path, result: Classification, now: float) -> list[int]:
    """Ask the nodes of the stalled ranks to restart; returns the node indices."""
    beats = read_all(Path(run_dir) / "heartbeats")
    nodes = sorted({int(beats[r]["node"]) for r in result.ranks if r in beats})
    control = Path(run_dir) / "control"
    control.mkdir(parents=True, exist_ok=True)
    for node in nodes:
        write_json_atomic(control / f"restart-node-{node:04d}.json",
                          {"time": now, "reason": result.message, "ranks": list(result.ranks)})
    record(run_dir, "stall_detected", verdict=result.verdict.value, ranks=list(result.ranks),
           nodes=nodes, steps={str(k): v for k, v in result.steps.items()}, message=result.message)
    return nodes
