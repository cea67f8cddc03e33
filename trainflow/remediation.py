"""Acting on heartbeat verdicts: node replacement requests and the run's abort record.

The heartbeat watch (in the triggerer) decides; it asks a node's shard_train task to
kill its agent and fail, so Airflow's retry replaces the node. The request is a small
file in the run's workspace that the task polls (embedded profile).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable

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


def ended_member(
    states: dict[int, str], *, me: int, finished: Callable[[int], bool] = lambda node: True
) -> tuple[int, str] | None:
    """A node of a fixed gang whose task ended for good while this node still runs.

    ``states`` maps node index to its Airflow task state. ``failed`` is final (a retry
    would be ``up_for_retry``): the node was marked failed (the UI's "Mark failed", a
    ``trainflow cancel``) or spent its tries, and ``upstream_failed``/``removed`` never run
    again. ``success`` counts when ``finished(node)`` says that node's try did not end by
    training to the end: a user marked it success while the gang trained (Airflow stopped
    it, and never runs it again). Such a gang can never be whole again; the caller ends the
    run instead of leaving its other nodes to wait for that member until their rendezvous
    times out.

    Returns:
        ``(node, state)`` of the first such node, or None.
    """
    for node, state in sorted(states.items()):
        if node == me:
            continue
        if state in ("failed", "upstream_failed", "removed") or (state == "success" and not finished(node)):
            return node, state
    return None


def node_finished(run_dir: Path, node: int) -> bool:
    """Whether node ``node``'s last try ended by training to the end (its task's marker,
    written before the task returns), or the run's training is complete."""
    from trainflow.workspace import completed

    try:
        last = json.loads((Path(run_dir) / "nodes" / f"task-{node:04d}.json").read_text())
    except (OSError, ValueError):
        last = {}
    return last.get("ended") == "succeeded" or completed(run_dir)


def end_for_member(run_dir: Path, node: int, state: str, *, now: float) -> str:
    """Write the abort record for a gang member that ended for good (see ``ended_member``)
    and return its message."""
    if state == "success":
        message = (
            f"node {node}'s task was marked success by a user while the gang trained (Airflow "
            f"stopped it and never runs it again): the gang cannot become whole, so the run ended"
        )
    else:
        message = (
            f"node {node}'s task is {state} with no retry to come (marked {state} by a user, "
            f"or its tries spent): the gang cannot become whole, so the run ended"
        )
    if abort(
        run_dir,
        {
            "rank": None,
            "node": node,
            "kind": "member_ended",
            "type": "GangMemberEnded",
            "message": message,
            "time": now,
        },
    ):
        record(run_dir, "member_ended", node=node, state=state, message=message)
    return message


def clear_abort(run_dir: Path, *, now: float) -> dict | None:
    """Set the run's abort record aside (a cleared run gets another chance: its nodes start
    again); returns the record that was set aside, if any."""
    path = Path(run_dir) / "ABORT"
    error = aborted(run_dir)
    if error is None:
        return None
    n = len(list(Path(run_dir).glob("ABORT.cleared-*")))
    os.replace(path, path.with_name(f"ABORT.cleared-{n}"))
    record(run_dir, "abort_cleared", set_aside=now, kind=error.get("kind"), message=error.get("message"))
    return error


def provisioned(run_dir: Path, plan_path: Path, previous_epoch: int, *, now: float) -> int:
    """Stamp the run's plan with its provision epoch (1 for a new run; one more each time
    a cleared run is provisioned again) and, on a repeat, set the last failure's abort
    record aside so the cleared run's nodes start again. Returns the epoch.

    ``previous_epoch``: the epoch of the plan that was there before (``plan_epoch`` read
    before the plan was rewritten; 0 for none)."""
    epoch = previous_epoch + 1
    plan = json.loads(Path(plan_path).read_text())
    write_json_atomic(Path(plan_path), {**plan, "epoch": epoch})
    if previous_epoch:
        cleared = clear_abort(run_dir, now=now)
        record(
            run_dir,
            "provisioned_again",
            epoch=epoch,
            after=(cleared or {}).get("message", "a failure without an abort record"),
        )
    return epoch


def plan_epoch(run_dir: Path) -> int:
    """The provision epoch of the run's current plan (0: no plan yet; 1: a plan from before
    epochs were recorded, or the first provision)."""
    try:
        return int(json.loads((Path(run_dir) / "plan.json").read_text()).get("epoch", 1))
    except (OSError, ValueError):
        return 0


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
    record(
        run_dir,
        "stall_detected",
        verdict=result.verdict.value,
        ranks=list(result.ranks),
        nodes=nodes,
        steps={str(k): v for k, v in result.steps.items()},
        message=result.message,
    )
    return nodes


def exclude_straggler(run_dir: Path, straggler: dict, *, checkpoint_step: int, now: float) -> int:
    """Replace the straggler's node and cordon its host (the node task does the cordon).

    Called once a checkpoint newer than the straggler's confirmation has committed, so
    the replacement resumes from it and loses only the restart time.
    """
    node = int(straggler["node"])
    reason = (
        f"straggler: rank {straggler['rank']} computes {straggler['compute_ms']} ms/step, "
        f"{100 * straggler['slower_by']:.0f}% slower than its peers' median "
        f"{straggler['median_ms']} ms"
    )
    _request(run_dir, node, {"time": now, "reason": reason, "ranks": [straggler["rank"]], "cordon": True})
    step = read_all(Path(run_dir) / "heartbeats").get(straggler["rank"], {}).get("step")
    record(
        run_dir,
        "straggler_excluded",
        node=node,
        rank=straggler["rank"],
        step=step,
        checkpoint_step=checkpoint_step,
        message=reason,
    )
    return node
