"""Runs as the training page shows them, read from their workspaces.

A run's workspace (``<root>/<tenant>/<dag_id>/<run_id>/``) is the source of truth: the plan
and spec (provision), per-rank heartbeats, node agents' status files, the loss curve rank 0
appends (``curve.jsonl``), checkpoints with manifests, the fault timeline, ``metrics.json``
(evaluate) and ``report.json``. Everything here only reads them; time is a parameter
(``now``), so each function is a pure function of the files and the clock it is given.
"""

from __future__ import annotations

import enum
import json
import time
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path
from typing import Any

from trainflow.bounds import clip
from trainflow.checkpoint.manifest import list_checkpoints, read_manifest, verify
from trainflow.errors import SpecError
from trainflow.goodput import summarize
from trainflow.heartbeat import HeartbeatPolicy, RankState, Verdict, classify, current_gang, node_starts, read_all
from trainflow.remediation import aborted
from trainflow.timeline import read as timeline_read
from trainflow.timeline import read_lines
from trainflow.workspace import Workspace, completed, preempted

# Loss points returned at most (a long run's curve is thinned evenly, its last point kept).
MAX_CURVE_POINTS = 1000
# Timeline events returned at most (the newest).
MAX_EVENTS = 500

# Timeline events, by what they mean for the run (unknown events count as faults: a new
# failure kind must not be hidden as routine).
RECOVERY_EVENTS = frozenset({"resumed", "membership", "straggler_excluded"})
ROUTINE_EVENTS = frozenset(
    {
        "gang_start",
        "first_step",
        "checkpoint_stall",
        "checkpoint_committed",
        "capacity_acquired",
        "disk_released",
        "grow_window",
    }
)


class RunNotFoundError(LookupError):
    """No run workspace with these names under the root (the API answers 404)."""


class RunState(str, enum.Enum):
    """A run as its files show it now.

    PENDING (planned, no rank has reported) → RUNNING → COMPLETED (rank 0 wrote
    ``control/complete.json``); RUNNING → HEALING (a worker exited, a node was lost or a
    stall was detected, and the gang has not trained a step since) → RUNNING; RUNNING →
    STALLED (a rank made no progress for the spec's ``heartbeat_timeout``, or never
    reported within ``startup_timeout``); RUNNING → PREEMPTED (stopped at a checkpoint for a
    higher-priority run) → RUNNING once admitted again; any state → FAILED (the run's ABORT
    record, or every node agent ended and one failed or aborted). STALLED and FAILED may
    still heal: the heartbeat watch and Airflow retries replace nodes.
    """

    PENDING = "pending"
    RUNNING = "running"
    HEALING = "healing"
    STALLED = "stalled"
    PREEMPTED = "preempted"
    COMPLETED = "completed"
    FAILED = "failed"


# States in which the gang trains no step.
_NOT_TRAINING = frozenset({RunState.HEALING, RunState.STALLED, RunState.PREEMPTED, RunState.FAILED})

# Observations that stop the gang's progress until it trains a step again ("first_step").
_STOPPING_EVENTS = frozenset({"worker_exited", "stall_detected", "node_lost", "node_task_lost"})


def _clock(t: Any) -> str:
    return time.strftime("%H:%M:%S UTC", time.gmtime(float(t))) if isinstance(t, (int, float)) else "?"


def _healing(events: list[dict], beats: dict[int, dict], checkpoints: Path) -> str | None:
    """Why the gang is not training, if its newest stopping observation came after its
    newest first step and after every rank's last progress; None when it trains."""
    last_fault = next((e for e in reversed(events) if e.get("event") in _STOPPING_EVENTS), None)
    if last_fault is None:
        return None
    at_fault = float(last_fault.get("time", 0))
    last_step = next((e for e in reversed(events) if e.get("event") == "first_step"), None)
    if last_step is not None and float(last_step.get("time", 0)) >= at_fault:
        return None
    if any(float(b.get("progress_time") or 0) > at_fault for b in beats.values()):
        return None
    at = _clock(last_fault.get("time"))
    if last_fault["event"] == "worker_exited":
        how = (
            f"signal {last_fault['signal']}" if last_fault.get("signal") else f"exit code {last_fault.get('exitcode')}"
        )
        what = f"rank {last_fault.get('rank')} exited ({how}) at {at}"
    else:
        what = f"{clip(str(last_fault.get('message') or last_fault['event']), 200)} at {at}"
    newest = list_checkpoints(checkpoints)
    start = f"checkpoint step {newest[0][0]}" if newest else "the newest verified checkpoint"
    return f"healing: {what}; the gang restarts together from {start}"


def _json(path: Path) -> Any:
    """The file's JSON, or None if it is missing or torn (writers replace files atomically,
    but a reader may still race a first write)."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def _json_dict(path: Path) -> dict:
    """The file's JSON object, or ``{}``."""
    value = _json(path)
    return value if isinstance(value, dict) else {}


def _workspace(root: Path, tenant: str, dag_id: str, run_id: str) -> Workspace:
    """The run's workspace; names are checked (``SpecError``) before any path is built."""
    return Workspace(Path(root), tenant, dag_id, run_id)


def _nodes(
    run_dir: Path,
    cordoned: Callable[[str], Any] | None = None,
    task_states: Callable[[], dict[int, str | None]] | None = None,
) -> list[dict]:
    """Each node agent's status, with the host its current task try runs on, the try within
    the run's retry budget and the tries the budget allows, the host's cordon (through
    ``cordoned(host)``, the host registry's lookup, where given) and the node task's Airflow
    state (``task_states()``: map index → state, where given)."""
    tasks = task_states() if task_states is not None else {}
    out = []
    for p in sorted((run_dir / "nodes").glob("node-*.json")):
        status = _json(p)
        if isinstance(status, dict) and "node" in status:
            row = {k: status.get(k) for k in ("node", "state", "started", "ended", "error")}
            row["task_state"] = tasks.get(int(status["node"]))
            task = _json_dict(run_dir / "nodes" / f"task-{int(status['node']):04d}.json")
            row["host"] = task.get("host")
            row["try"] = task.get("run_try", task.get("try"))
            tries = task.get("tries")
            row["tries_left"] = None if tries is None or row["try"] is None else max(0, int(tries) - int(row["try"]))
            cordon = cordoned(row["host"]) if cordoned is not None and row["host"] else None
            row["cordoned"] = None if cordon is None else {"since": cordon.since, "reason": clip(cordon.reason)}
            out.append(row)
    return out


def _allocation(run_dir: Path, spec: dict) -> dict | None:
    """The run's capacity: its pool, the slots holding a node now, the slots it may use
    (the gang's largest size plus its spares), and when the release teardown gave them back
    (None while held). None before provision admitted it."""
    lease = _json_dict(run_dir / "nodes" / "lease.json")
    if not lease:
        return None
    nodes = spec.get("nodes")
    top = int(str(nodes).split(":")[-1]) if nodes is not None and str(nodes).split(":")[-1].isdigit() else None
    released = _json_dict(run_dir / "nodes" / "released.json")  # the release teardown ran
    return {
        "pool": lease.get("pool"),
        "held": 0 if released else len(list((run_dir / "nodes").glob("slot-*.held"))),
        "slots": None if top is None else top + int(spec.get("spares") or 0),
        "released": released.get("time"),
    }


def _goodput(run_dir: Path, nodes: list[dict], step: int | None, now: float, events: list[dict]) -> dict | None:
    """The run's goodput so far (``goodput.summarize`` over the node agents' lifetime, up to
    now while one still runs); None before any node agent started."""
    starts = [float(n["started"]) for n in nodes if n.get("started")]
    if not starts:
        return None
    ends = [float(n["ended"]) for n in nodes if n.get("ended")]
    live = len(ends) < len(nodes)
    ended = now if live or not ends else max(ends)
    return summarize(run_dir, started=min(starts), ended=ended, steps=int(step or 0), events=events)


def _state(
    run_dir: Path,
    spec: dict,
    world_size: int,
    beats: dict[int, dict],
    nodes: list[dict],
    events: list[dict],
    started_at: float,
    now: float,
) -> tuple[RunState, str]:
    """Decide the run's state and say why. Pure apart from reading the control files."""
    if completed(run_dir):
        return RunState.COMPLETED, "training finished (control/complete.json)"
    if (abort := aborted(run_dir)) is not None:
        when = f" at {_clock(abort['time'])}" if isinstance(abort.get("time"), (int, float)) else ""
        return RunState.FAILED, f"ended{when}: {abort.get('message', abort)}"
    if (stop := preempted(run_dir)) is not None:
        if "requested" in stop:
            by = (stop["requested"] or {}).get("by", "a higher-priority run")
            return RunState.PREEMPTED, f"preempted by {by}: stopping at the next checkpoint"
        return RunState.PREEMPTED, (
            f"preempted by {stop.get('by', 'a higher-priority run')} at step {stop.get('step')}: waits in the "
            "pool's queue and resumes from that checkpoint"
        )
    ended = [n for n in nodes if n["state"] not in ("running", None)]
    if nodes and len(ended) == len(nodes) and any(n["state"] in ("failed", "aborted") for n in ended):
        bad = next(n for n in ended if n["state"] in ("failed", "aborted"))
        return RunState.FAILED, f"node {bad['node']} {bad['state']}: {bad.get('error') or 'no error recorded'}"
    if not beats:
        return RunState.PENDING, "no rank has reported yet"
    if (why := _healing(events, beats, run_dir / "checkpoints")) is not None:
        return RunState.HEALING, why
    policy = HeartbeatPolicy(
        timeout=float(spec.get("heartbeat_timeout", 60.0)),
        startup_timeout=float(spec.get("startup_timeout", 300.0)),
        checkpoint_timeout=spec.get("checkpoint_timeout"),
        stall_timeout=spec.get("stall_timeout"),
    )
    verdict = classify(
        beats, now=now, world_size=world_size, started_at=started_at, policy=policy, node_started=node_starts(run_dir)
    )
    if verdict.verdict in (Verdict.STALLED, Verdict.STARTUP_TIMEOUT):
        return RunState.STALLED, verdict.message
    return RunState.RUNNING, verdict.message


def _summary(ws: Workspace, now: float) -> tuple[dict, dict | None, list[dict]]:
    """The run's row of the list, and for the detail view its goodput summary
    (``goodput.summarize``) and its timeline, each computed or read once."""
    run_dir = ws.dir
    plan = _json_dict(ws.plan_file)
    spec = plan.get("spec") or _json_dict(ws.spec_file)
    world_size = int(plan.get("world_size") or 0)
    beats = read_all(ws.heartbeats)
    gang, world = current_gang(beats, world_size) if beats else ({}, world_size)
    nodes = _nodes(run_dir)
    starts = [float(n["started"]) for n in nodes if n.get("started")]
    planned = ws.plan_file.stat().st_mtime if ws.plan_file.exists() else now
    events = timeline_read(run_dir)
    state, reason = _state(run_dir, spec, world_size, beats, nodes, events, min(starts, default=planned), now)
    steps = [int(b.get("step", 0)) for b in gang.values()]
    last_beat = max((float(b.get("alive", b.get("time", 0))) for b in beats.values()), default=None)
    rank0 = gang.get(0) or {}
    good = _goodput(run_dir, nodes, min(steps) if steps else None, now, events)
    return (
        {
            "tenant": ws.tenant,
            "dag_id": ws.dag_id,
            "run_id": ws.run_id,
            "workload": spec.get("workload"),
            "chip": spec.get("chip"),
            "strategy": spec.get("strategy"),
            "nodes": spec.get("nodes"),
            "world_size": world_size,
            "current_world_size": world if beats else None,
            "ranks_reporting": len(gang),
            "step": min(steps) if steps else None,
            "total_steps": spec.get("steps"),
            "loss": rank0.get("loss"),
            # Each rank reports its own samples/s; the gang's throughput is their sum — and 0 while
            # it does not train (its ranks' last rates are history, not throughput).
            "samples_per_s": (
                0.0
                if state in _NOT_TRAINING
                else round(sum(float(b.get("samples_per_s") or 0.0) for b in gang.values()), 1)
            )
            if gang
            else None,
            "last_heartbeat_age_s": None if last_beat is None else round(max(0.0, now - last_beat), 3),
            "state": state.value,
            "state_reason": reason,
            "evaluated": ws.metrics_file.exists(),
            "goodput": None if good is None else good["goodput"],
            "allocation": _allocation(run_dir, spec),
            "updated": max(last_beat or 0.0, planned),
        },
        good,
        events,
    )


def list_runs(
    root: Path, *, now: float | None = None, tenant: str | None = None, dag_id: str | None = None
) -> list[dict]:
    """Every run under ``root`` (optionally of one tenant or DAG), newest activity first.

    Directories whose names are not valid workspace names, and directories without a plan
    or spec, are skipped.
    """
    now = time.time() if now is None else now
    root = Path(root)
    runs = []
    for tdir in sorted(root.iterdir()) if root.is_dir() else []:
        if tenant is not None and tdir.name != tenant:
            continue
        for ddir in sorted(tdir.iterdir()) if tdir.is_dir() else []:
            if dag_id is not None and ddir.name != dag_id:
                continue
            for rdir in sorted(ddir.iterdir()) if ddir.is_dir() else []:
                if not (rdir / "plan.json").exists() and not (rdir / "spec.json").exists():
                    continue
                try:
                    ws = _workspace(root, tdir.name, ddir.name, rdir.name)
                except SpecError:
                    continue
                runs.append(_summary(ws, now)[0])
    return sorted(runs, key=lambda r: r["updated"], reverse=True)


def _ranks(beats: dict[int, dict], gang: dict[int, dict], timeout: float, now: float) -> list[dict]:
    out = []
    for r, b in sorted(beats.items()):
        progress_age = now - float(b.get("progress_time", b.get("time", now)))
        alive_age = now - float(b.get("alive", b.get("time", now)))
        state = b.get("state")
        # A rank left over from a larger gang (an elastic run shrank) is not watched.
        healthy = (
            r in gang and state != RankState.FAILED.value and (state == RankState.DONE.value or progress_age <= timeout)
        )
        out.append(
            {
                "rank": r,
                "node": b.get("node"),
                "pid": b.get("pid"),
                "state": state,
                "step": b.get("step"),
                "total": b.get("total"),
                "loss": b.get("loss"),
                "samples_per_s": b.get("samples_per_s") if healthy else 0.0,
                "compute_ms": b.get("compute_ms"),
                "phase": b.get("phase"),
                "checkpoint_step": b.get("checkpoint_step"),
                "progress_age_s": round(max(0.0, progress_age), 3),
                "alive_age_s": round(max(0.0, alive_age), 3),
                "in_gang": r in gang,
                "healthy": healthy,
            }
        )
    return out


def _curve(run_dir: Path) -> list[dict]:
    points = [
        {"step": int(p["step"]), "loss": float(p["loss"]), "time": p.get("time")}
        for p in read_lines(run_dir / "curve.jsonl")
        if "step" in p and "loss" in p
    ]
    if len(points) > MAX_CURVE_POINTS:
        stride = -(-len(points) // MAX_CURVE_POINTS)
        points = points[::stride] + ([points[-1]] if (len(points) - 1) % stride else [])
    return points


@lru_cache(maxsize=4096)
def _verified(path: str, fingerprint: tuple) -> bool:
    """``verify`` of a committed checkpoint, once per content: a committed directory does
    not change, and the page refreshes every few seconds (hashing a large checkpoint each
    time would cost seconds of CPU). ``fingerprint`` (sizes and mtimes) keys the cache."""
    return verify(Path(path)) is not None


def _fingerprint(path: Path) -> tuple:
    return tuple(
        sorted((p.name, st.st_size, st.st_mtime_ns) for p in path.rglob("*") if p.is_file() and (st := p.stat()))
    )


def _checkpoints(ckpt_root: Path) -> list[dict]:
    out = []
    for step, path in list_checkpoints(ckpt_root):
        manifest = read_manifest(path) or {}
        files = manifest.get("files") or {}
        out.append(
            {
                "step": step,
                "path": str(path),
                "bytes": sum(int(m.get("size", 0)) for m in files.values() if isinstance(m, dict)),
                "files": len(files),
                "world_size": manifest.get("world_size"),
                "training_hash": manifest.get("training_hash"),
                "created": manifest.get("created"),
                "verified": bool(manifest) and _verified(str(path), _fingerprint(path)),
            }
        )
    return out


def _kind(event: str) -> str:
    if event in ROUTINE_EVENTS:
        return "info"
    return "recovery" if event in RECOVERY_EVENTS else "fault"


def run_detail(
    root: Path,
    tenant: str,
    dag_id: str,
    run_id: str,
    *,
    now: float | None = None,
    cordoned: Callable[[str], Any] | None = None,
    task_states: Callable[[str, str], dict[int, str | None]] | None = None,
) -> dict:
    """One run: its summary, rank and node health, loss curve, evaluation, checkpoints,
    errors and timeline. ``cordoned(host)`` (the host registry's lookup) adds each node's
    host cordon; ``task_states(dag_id, run_id)`` (Airflow's, map index → state) each node
    task's state.

    Raises:
        SpecError: a name is not a valid workspace name (it would escape the root).
        RunNotFoundError: no such run under ``root``.
    """
    now = time.time() if now is None else now
    ws = _workspace(root, tenant, dag_id, run_id)
    if not ws.dir.is_dir() or not (ws.plan_file.exists() or ws.spec_file.exists()):
        raise RunNotFoundError(f"no run {tenant}/{dag_id}/{run_id}: no workspace with a plan or spec")
    summary, good, timeline = _summary(ws, now)
    plan = _json_dict(ws.plan_file)
    spec = plan.get("spec") or _json_dict(ws.spec_file)
    beats = read_all(ws.heartbeats)
    gang, _ = current_gang(beats, int(plan.get("world_size") or 0)) if beats else ({}, 0)
    metrics = _json(ws.metrics_file)
    errors = []
    for p in sorted((ws.dir / "errors").glob("rank-*.json")):
        e = _json(p)
        if isinstance(e, dict):
            errors.append(
                {**{k: e.get(k) for k in ("rank", "kind", "type", "time")}, "message": clip(e.get("message"))}
            )
    events = [{**e, "kind": _kind(str(e.get("event")))} for e in timeline if "event" in e]
    good = good or {}
    return {
        **summary,
        "spec": spec,
        "ranks": _ranks(beats, gang, float(spec.get("heartbeat_timeout", 60.0)), now),
        "node_agents": _nodes(ws.dir, cordoned, None if task_states is None else (lambda: task_states(dag_id, run_id))),
        "loss_curve": _curve(ws.dir),
        "evaluation": metrics if isinstance(metrics, dict) else None,
        "report_available": ws.report_file.exists(),
        "checkpoints": _checkpoints(ws.checkpoints),
        "errors": errors,
        "timeline": events[-MAX_EVENTS:],
        # Each fault with its detection, recovery and steps lost (goodput.fault_records), and
        # every change of the gang's members (elastic shrink/grow, a hot spare taking over).
        "faults": (good.get("faults") or [])[-MAX_EVENTS:],
        "membership": (good.get("membership") or [])[-MAX_EVENTS:],
        "recovery_s": good.get("recovery_s"),
        "steps_lost": good.get("steps_lost"),
        "now": now,
    }


__all__ = ["RunNotFoundError", "RunState", "list_runs", "run_detail"]
