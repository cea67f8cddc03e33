"""Goodput accounting from the run's timeline: per fault, when it happened, when it was
detected, when training resumed and how many steps were lost; and the share of the run's
wall time that went into training that was kept."""

from __future__ import annotations

from pathlib import Path

from trainflow import timeline

# Faults that do not stop training by themselves: a failed save (fill_disk), a slow rank,
# withheld heartbeats. They restart the gang only if the watch then declares a stall.
NO_RESTART = {"fill_disk", "slow_rank", "delay_heartbeats"}


def exit_cause(e: dict) -> str:
    """``rank 1 ended by SIGKILL`` / ``rank 1 exited with code 1``, from a ``worker_exited``."""
    how = f"ended by {e['signal']}" if e.get("signal") else f"exited with code {e.get('exitcode')}"
    return f"rank {e.get('rank')} {how}"


def _stalled_at(e: dict) -> int | None:
    """The step a stall stopped the gang in: one past the last step every rank finished
    (``stall_detected`` carries each rank's step), so the steps after the resume point are
    counted as lost like any fault's."""
    steps = [int(v) for v in (e.get("steps") or {}).values() if v is not None and int(v) >= 0]
    return min(steps) + 1 if steps else None


def _opened(e: dict, kind: str, source: str) -> dict:
    """A fault record opened by event ``e`` that stops training until a gang resumes."""
    return {"kind": kind, "source": source, "time": e["time"], "step": e.get("step"), "restarts": True}


def fault_records(events: list[dict]) -> list[dict]:
    """Pair each fault and each grow window with the next resume after it; a membership
    change at that resume (shrink, grow, spare used) is attached.

    A fault is what happened, whoever caused it: an injected fault, a stall the watch
    detected, a user error, a straggler excluded, a worker that exited while the gang
    trained (``worker_exited``, observed by its node agent: a signal from outside, a crash,
    an OOM kill), a node task lost without a word (``node_task_lost``, found by its next
    try), a node agent killed by a signal (``agent_exited``, seen by its node task), a user's control that ended the run (``member_ended``) or a preemption. Exits seen while a fault is open belong to it (the first is its cause:
    the other ranks' exits follow from it); an exit with no open fault opens one
    (``kind: worker_exit``, ``source: outside``)."""
    out: list[dict] = []
    for e in events:
        if "event" not in e or "time" not in e:
            continue  # not an event of ours (a foreign or damaged line)
        if e["event"] == "worker_exited":
            open_ = [rec for rec in out if rec["restarts"] and "resumed_time" not in rec]
            if open_:
                rec = open_[-1]
                if e.get("signal") and " exited with code " in rec.get("cause", ""):
                    # A rank killed by a signal is the cause; its peers' exit codes (a broken
                    # collective) follow from it, whichever agent saw its exit first.
                    rec["cause"] = exit_cause(e)
                    if rec["kind"] == "worker_exit":
                        rec["rank"] = e.get("rank")
                rec.setdefault("cause", exit_cause(e))
                if rec.get("step") is None:  # opened by an event that knew no step (a dead agent)
                    rec["step"] = e.get("step")
                rec["exits"] = rec.get("exits", 0) + 1
                continue
            out.append(
                {
                    "kind": "worker_exit",
                    "source": "outside",
                    "cause": exit_cause(e),
                    "time": e["time"],
                    "step": e.get("step"),
                    "rank": e.get("rank"),
                    "restarts": True,
                    "exits": 1,
                }
            )
            continue
        if e["event"] in ("node_task_lost", "agent_exited"):
            # A node task's try died without a word (SIGKILL from outside, an OOM kill, its
            # host gone), found by the next try; or a node's agent died of a signal, seen by
            # its node task: the cause of the restart it set off.
            if e["event"] == "agent_exited":
                cause = f"node {e.get('node')}'s agent ended by {e.get('signal')}"
            else:
                cause = f"node {e.get('node')}'s task (try {e.get('try')} on {e.get('host')}) was lost"
            open_ = [rec for rec in out if rec["restarts"] and "resumed_time" not in rec]
            if open_:
                rec = open_[-1]
                if rec["kind"] == "worker_exit":  # the survivors' exits followed from it
                    rec["kind"] = "node_lost"
                    rec["cause"] = cause
                else:
                    rec.setdefault("cause", cause)
                continue
            out.append({**_opened(e, "node_lost", "outside"), "cause": cause, "node": e.get("node")})
            continue
        if e["event"] in ("member_ended", "preempted"):
            # A user's control (a node task marked failed or success: the run ends) or the
            # pool's (a preemption: the gang stops at a checkpoint and waits to be admitted
            # again); open until a gang trains again.
            if e["event"] == "member_ended":
                rec = {**_opened(e, "user_action", "user"), "cause": e.get("message"), "node": e.get("node")}
            else:
                rec = {**_opened(e, "preemption", "pool"), "cause": f"preempted for {e.get('by')}"}
            out.append(rec)
            continue
        if e["event"] == "membership":
            # the gang that resumed has other members: say so on the record it ended
            resumed = [rec for rec in out if rec.get("resumed_time", 0) <= e["time"] and "membership" not in rec]
            if resumed:
                resumed[-1]["membership"] = {
                    k: e[k] for k in ("change", "world_from", "world_to", "joined", "left") if k in e
                }
            continue
        if e["event"] in ("fault_injected", "stall_detected", "user_error", "straggler_excluded", "grow_window"):
            if (
                e["event"] == "stall_detected"
                and out
                and "resumed_time" not in out[-1]
                and out[-1]["kind"] not in ("fill_disk", "slow_rank")
            ):
                out[-1]["detected_time"] = e["time"]  # the watch detected the injected fault
                out[-1]["detection_s"] = round(e["time"] - out[-1]["time"], 3)
                out[-1]["restarts"] = True
                continue
            kind = (
                "grow"
                if e["event"] == "grow_window"
                else e["event"]
                if e["event"] == "straggler_excluded"
                else e.get("kind", e["event"])
            )
            out.append(
                {
                    "kind": kind,
                    "source": "injected" if e["event"] == "fault_injected" else "detected",
                    "time": e["time"],
                    "step": e.get("step", _stalled_at(e)),
                    "restarts": kind not in NO_RESTART,
                    **({"detected_time": e["time"], "detection_s": 0.0} if e["event"] == "stall_detected" else {}),
                }
            )
        elif e["event"] in ("resumed", "first_step"):
            # A gang that restarted with no verified checkpoint starts over without a
            # "resumed": its first step ends the fault then (from step 0).
            start = e["step"] if e["event"] == "resumed" else max(0, int(e.get("step") or 1) - 1)
            for rec in out:
                if rec["restarts"] and "resumed_time" not in rec and rec["time"] <= e["time"]:
                    rec["resumed_time"] = e["time"]
                    rec["recovery_s"] = round(e["time"] - rec["time"], 3)
                    rec["resumed_from_step"] = start
                    if rec.get("step") is not None:
                        rec["steps_lost"] = max(0, rec["step"] - 1 - start)
    return out


def summarize(run_dir: Path, *, started: float, ended: float, steps: int, events: list[dict] | None = None) -> dict:
    """Fault timeline and goodput of a finished run.

    goodput = 1 − (time spent recovering + time spent redoing lost steps) / wall time,
    with the step time taken from the run itself. ``events``: the run's timeline, where the
    caller has read it already.
    """
    events = [e for e in (timeline.read(run_dir) if events is None else events) if "event" in e and "time" in e]
    faults = fault_records(events)
    wall = max(ended - started, 1e-9)
    for f in faults:
        if f.get("restarts") and "recovery_s" not in f:
            # Still open (the gang has not trained since): charged up to ``ended``, which for
            # a live run is now, so a run that is down reads its goodput falling.
            f["open"] = True
            f["open_s"] = round(max(0.0, ended - float(f["time"])), 3)
    recovering = sum(f.get("recovery_s", f.get("open_s", 0.0)) for f in faults)
    lost = sum(f.get("steps_lost", 0) for f in faults)
    step_time = max(wall - recovering, 0.0) / max(steps + lost, 1)
    wasted = recovering + lost * step_time
    return {
        "faults": faults,
        "membership": [
            {
                k: e[k]
                for k in (
                    "time",
                    "step",
                    "change",
                    "world_from",
                    "world_to",
                    "nodes_from",
                    "nodes_to",
                    "joined",
                    "left",
                    "spares_used",
                )
                if k in e
            }
            for e in events
            if e["event"] == "membership"
        ],
        "wall_s": round(wall, 3),
        "recovery_s": round(recovering, 3),
        "steps_lost": lost,
        "goodput": round(max(0.0, 1 - wasted / wall), 4),
    }
