"""Run workspaces: one isolated directory per (tenant, DAG, run).

Every name that becomes a path component is checked against a strict pattern, and the
resolved path must stay inside the root, so no run id, tenant or DAG id can escape.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from trainflow.errors import SpecError

# Airflow's default allowed_run_id_pattern plus the characters of its generated ids.
RUN_ID_PATTERN = r"^[A-Za-z0-9_][A-Za-z0-9_.:+~-]{0,249}$"
DAG_ID_PATTERN = r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,249}$"


# Control files of a run (``<run_dir>/control/``): rank 0 writes COMPLETE when training
# finished (standing spares and slots waiting for capacity then end); a node waiting to join
# an elastic gang writes a grow request, and rank 0 answers with GROW_ACK.
COMPLETE = "complete.json"
GROW_ACK = "grow-ack.json"
GROW_REQUEST_GLOB = "grow-request-*.json"
# Preemption: a node task writes PREEMPT_REQUEST when the allocator orders the run stopped;
# rank 0 answers with PREEMPTED (the step of the checkpoint the gang stopped at) once every
# rank has stopped there. Both go when the run is admitted again.
PREEMPT_REQUEST = "preempt-request.json"
PREEMPTED = "preempted.json"


def preempted(run_dir: str | Path) -> dict | None:
    """The run's preemption record while it is preempted or asked to stop: ``PREEMPTED``'s
    content once the gang stopped, else ``{"requested": ...}``; None otherwise."""
    import json

    control = Path(run_dir) / "control"
    for name, key in ((PREEMPTED, None), (PREEMPT_REQUEST, "requested")):
        try:
            info = json.loads((control / name).read_text())
        except (OSError, ValueError):
            continue
        return info if key is None else {key: info}
    return None


def completed(run_dir: str | Path) -> bool:
    """The run's training finished (``control/complete.json`` exists)."""
    return (Path(run_dir) / "control" / COMPLETE).exists()


def default_root() -> Path:
    """Root of all workspaces: ``$TRAINFLOW_HOME/runs`` (default ``~/.trainflow/runs``)."""
    home = os.environ.get("TRAINFLOW_HOME") or os.path.join(os.path.expanduser("~"), ".trainflow")
    return Path(home) / "runs"


def check_name(field: str, value: str, pattern: str) -> str:
    """Return ``value`` if it is a safe path component, else raise ``SpecError``."""
    if not isinstance(value, str) or not re.fullmatch(pattern, value) or ".." in value:
        raise SpecError(field, value, f"must match {pattern} and must not contain '..'")
    return value


@dataclass(frozen=True)
class Workspace:
    """The directory tree of one run. Pure path arithmetic; ``create`` does the I/O."""

    root: Path
    tenant: str
    dag_id: str
    run_id: str

    def __post_init__(self) -> None:
        check_name("tenant", self.tenant, r"^[a-z0-9][a-z0-9-]{0,62}$")
        check_name("dag_id", self.dag_id, DAG_ID_PATTERN)
        check_name("run_id", self.run_id, RUN_ID_PATTERN)
        root = Path(self.root).resolve()
        object.__setattr__(self, "root", root)
        if root not in self.dir.resolve().parents:
            raise SpecError("run_id", self.run_id, "resolves outside the workspace root")

    @property
    def dir(self) -> Path:
        return self.root / self.tenant / self.dag_id / self.run_id

    @property
    def checkpoints(self) -> Path:
        return self.dir / "checkpoints"

    @property
    def heartbeats(self) -> Path:
        return self.dir / "heartbeats"

    @property
    def logs(self) -> Path:
        return self.dir / "logs"

    @property
    def spec_file(self) -> Path:
        return self.dir / "spec.json"

    @property
    def plan_file(self) -> Path:
        return self.dir / "plan.json"

    @property
    def metrics_file(self) -> Path:
        return self.dir / "metrics.json"

    @property
    def report_file(self) -> Path:
        return self.dir / "report.json"

    def create(self) -> "Workspace":
        for d in (self.checkpoints, self.heartbeats, self.logs):
            d.mkdir(parents=True, exist_ok=True)
        return self


def write_json_atomic(path: Path, data: object) -> None:
    """Write JSON so readers see the old or the new file, never a torn one."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as fh:
        json.dump(data, fh, indent=1, sort_keys=True)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
