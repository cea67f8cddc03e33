"""Run a whole gang on this machine without Airflow (tests, benchmarks, ``trainflow train``).

It prepares the workspace exactly as the provision task does and starts one node agent
per node as a subprocess in its own process session.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Iterator

from trainflow.plan import build_plan
from trainflow.spec import TrainingSpec
from trainflow.workspace import COMPLETE, GROW_ACK, GROW_REQUEST_GLOB, write_json_atomic


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def embedded_env() -> dict[str, str]:
    """Environment for gangs whose nodes all live on this machine (loopback)."""
    return {"GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo")}


def prepare(
    spec: TrainingSpec,
    run_dir: Path,
    *,
    dag_id: str = "local",
    run_id: str = "local",
    max_restarts: int | None = None,
    rdzv_backend: str = "trainflow-db",
) -> Path:
    """Write spec.json and plan.json into ``run_dir``; return the plan's path.

    The gang's rendezvous is trainflow's PostgreSQL database when ``TRAINFLOW_STATE_DB``
    names one (the distributed profile), else a database in the run's workspace (every node
    of an embedded gang shares this machine's disk); its rows are emptied here, so a cleared
    run starts a fresh gang.
    ``rdzv_backend="c10d"`` puts it on torch's store on a free loopback port instead (for
    comparisons: it is lost with the node that hosts it).
    """
    from trainflow.launch import rdzv_db
    from trainflow.plan import rendezvous_id

    run_dir = Path(run_dir).resolve()
    for sub in ("checkpoints", "heartbeats", "logs", "control"):
        (run_dir / sub).mkdir(parents=True, exist_ok=True)
    for stale in (COMPLETE, GROW_ACK, *(p.name for p in (run_dir / "control").glob(GROW_REQUEST_GLOB))):
        (run_dir / "control" / stale).unlink(missing_ok=True)  # of an earlier try of this run
    if rdzv_backend == rdzv_db.BACKEND:
        from trainflow.statedb import default_target, is_postgres, redact

        state = default_target()
        if is_postgres(state):  # distributed: the rendezvous on trainflow's PostgreSQL database
            if redact(state) != state:
                raise ValueError(
                    f"TRAINFLOW_STATE_DB={redact(state)} carries a password, which would land "
                    f"in the run's plan (an XCom); give it through PGPASSWORD or ~/.pgpass"
                )
            db = state
        else:  # embedded: a database in the run's workspace
            db = run_dir / "rendezvous.db"
        endpoint = rdzv_db.endpoint(db)
        rdzv_db.purge(db, rendezvous_id(spec.tenant, dag_id, run_id))
    else:
        endpoint = f"127.0.0.1:{free_port()}"
    plan = build_plan(
        spec,
        dag_id=dag_id,
        run_id=run_id,
        run_dir=str(run_dir),
        rdzv_endpoint=endpoint,
        rdzv_backend=rdzv_backend,
        env=embedded_env(),
        max_restarts=max_restarts,
    )
    write_json_atomic(run_dir / "spec.json", spec.to_dict())
    write_json_atomic(run_dir / "plan.json", plan)
    return run_dir / "plan.json"


def start_agent(plan_path: Path, node: int, *, log_dir: Path | None = None) -> subprocess.Popen:
    """Start node ``node``'s agent (also how a test replaces a lost node, as a task retry would)."""
    out = open(log_dir / f"agent-{node}.log", "ab") if log_dir else None
    return subprocess.Popen(
        [sys.executable, "-m", "trainflow.launch.agent", "--plan", str(plan_path), "--node", str(node)],
        stdout=out,
        stderr=subprocess.STDOUT if out else None,
        start_new_session=True,
    )


def start_agents(plan_path: Path, nodes: int, *, log_dir: Path | None = None) -> list[subprocess.Popen]:
    return [start_agent(plan_path, node, log_dir=log_dir) for node in range(nodes)]


def kill_tree(proc: subprocess.Popen | int, sig: int = signal.SIGKILL) -> None:
    """Signal the agent and every descendant.

    The elastic agent starts its workers in sessions of their own, so a process-group
    kill would leave them training as orphans: collect the whole tree first.
    """
    from trainflow.proctree import signal_tree

    signal_tree(proc if isinstance(proc, int) else proc.pid, sig)


def stop_agents(procs: list[subprocess.Popen]) -> None:
    """Kill the trees of the agents still running and reap every agent."""
    for p in procs:
        if p.poll() is None:
            kill_tree(p)
        p.wait()


@contextlib.contextmanager
def gang(spec: TrainingSpec, run_dir: Path) -> Iterator[list[subprocess.Popen]]:
    """Prepare ``run_dir`` and start ``spec``'s node agents (the full gang and its hot
    spares); stop whatever still runs on exit."""
    procs = start_agents(prepare(spec, run_dir), spec.max_nodes + spec.spares, log_dir=Path(run_dir) / "logs")
    try:
        yield procs
    finally:
        stop_agents(procs)


def run_local(spec: TrainingSpec, run_dir: Path, *, timeout: float = 1800) -> list[int]:
    """Train ``spec`` on this machine; return the agents' exit codes."""
    with gang(spec, run_dir) as procs:
        return [p.wait(timeout=timeout) for p in procs]
