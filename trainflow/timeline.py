"""The run's fault timeline: an append-only JSON-lines file in the workspace.

Workers, agents and the heartbeat watch append events (fault injected, stall detected,
node restart requested, resumed ...); the report derives detection and recovery times and
steps lost from it.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

MAX_LINE = 4096


def append(path: Path, obj: dict) -> None:
    """Append one JSON line (a single O_APPEND write of < 4 KiB, so concurrent writers do
    not tear)."""
    from trainflow.bounds import clip_fields

    line = json.dumps(obj, sort_keys=True)
    if len(line.encode()) >= MAX_LINE:  # clip long texts (a cut line would not parse: the event lost)
        for limit in (512, 64):
            obj = clip_fields(obj, limit)
            line = json.dumps(obj, sort_keys=True)
            if len(line.encode()) < MAX_LINE:
                break
        else:  # still too long (many fields): keep what identifies the event
            line = json.dumps(
                {k: obj[k] for k in ("time", "event", "step", "rank", "kind") if k in obj} | {"clipped": True},
                sort_keys=True,
            )
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        if os.geteuid() == 0:  # a root writer (task, agent) must not take the file from the
            own = os.stat(os.path.dirname(os.path.abspath(path)))  # tenant user the folder
            if os.fstat(fd).st_uid != own.st_uid:  # belongs to (launch.runas): its workers append too
                os.fchown(fd, own.st_uid, own.st_gid)
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


def record(run_dir: Path, event: str, **fields) -> None:
    """Append one event to the run's timeline."""
    append(Path(run_dir) / "timeline.jsonl", {"time": time.time(), "event": event, **fields})


def read_lines(path: Path) -> list[dict]:
    """Every parseable JSON line of ``path`` (none if it does not exist)."""
    path = Path(path)
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def read(run_dir: Path) -> list[dict]:
    return read_lines(Path(run_dir) / "timeline.jsonl")
