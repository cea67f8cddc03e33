"""The run report: one JSON document with what a run did and reached."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from trainflow.bounds import clip, newest
from trainflow.goodput import summarize
from trainflow.heartbeat import current_gang, read_all
from trainflow.timeline import read as timeline_read
from trainflow.workspace import write_json_atomic


def build_report(run_dir: Path, *, metrics: dict[str, Any], checkpoint: dict[str, Any] | None) -> dict:
    run_dir = Path(run_dir)
    plan = json.loads((run_dir / "plan.json").read_text())
    beats = read_all(run_dir / "heartbeats")
    events = timeline_read(run_dir)
    nodes = {}
    for p in sorted((run_dir / "nodes").glob("node-*.json")):
        status = json.loads(p.read_text())
        nodes[str(status["node"])] = status
    errors = (
        [json.loads(p.read_text()) for p in sorted((run_dir / "errors").glob("rank-*.json"))]
        if (run_dir / "errors").is_dir()
        else []
    )
    starts = [float(n["started"]) for n in nodes.values() if "started" in n]
    ends = [float(n["ended"]) for n in nodes.values() if "ended" in n]
    goodput = (
        summarize(run_dir, started=min(starts), ended=max(ends), steps=int(plan["spec"]["steps"]), events=events)
        if starts and ends
        else None
    )
    if goodput:
        goodput["faults"], goodput["membership"] = newest(goodput["faults"]), newest(goodput["membership"])
    return {
        "generated": time.time(),
        "goodput": goodput,
        "dag_id": plan["dag_id"],
        "run_id": plan["run_id"],
        "tenant": plan["tenant"],
        "spec": plan["spec"],
        "world_size": plan["world_size"],
        "queue": plan["queue"],
        "nodes": nodes,
        "ranks": {
            str(r): {k: b.get(k) for k in ("node", "step", "loss", "samples_per_s", "state")}
            for r, b in sorted(current_gang(beats, plan["world_size"])[0].items())
        },
        "checkpoint": checkpoint,
        "metrics": metrics,
        # Bounded: each list keeps its newest items, each message its head (``bounds``).
        "stragglers": newest(
            [{k: v for k, v in e.items() if k != "event"} for e in events if e["event"] == "straggler"]
        ),
        "membership": newest(
            [{k: v for k, v in e.items() if k != "event"} for e in events if e["event"] == "membership"]
        ),
        "errors": newest(
            [
                {"rank": e.get("rank"), "type": clip(e.get("type"), 200), "message": clip(e.get("message"))}
                for e in errors
            ]
        ),
    }


def write_report(run_dir: Path, report: dict) -> Path:
    path = Path(run_dir) / "report.json"
    write_json_atomic(path, report)
    return path
