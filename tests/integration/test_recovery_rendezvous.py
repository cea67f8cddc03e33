"""Lost nodes and late joiners on real gangs (no Airflow) with the agent's fast rendezvous
pace: a replacement agent started later (as a task retry is) joins the survivors. On the
database rendezvous no node hosts anything the others need, so losing either node,
node 0 included, costs only that node; on torch's c10d store, losing the node that hosts
it fails the survivor too. Either way the run ends with the same weights as a clean run."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import pytest

from trainflow.launch.local import prepare, run_local, start_agent
from trainflow.spec import TrainingSpec
from trainflow.timeline import read as read_timeline
from trainflow.worker.evaluate import evaluate

BASE = dict(workload="digits", nodes=2, steps=240, batch_size=16, checkpoint_interval=20, keep_last=3, seed=7)


@pytest.fixture(scope="module")
def clean_digest(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("clean")
    assert run_local(TrainingSpec(**BASE), run_dir) == [0, 0]
    return evaluate(run_dir)["weights_sha256"]


def _wait_for_store(endpoint: str, timeout: float = 180) -> None:
    """Until the endpoint accepts connections: the first agent hosts the c10d store."""
    host, port = endpoint.rsplit(":", 1)
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            socket.create_connection((host, int(port)), timeout=1).close()
            return
        except OSError:
            time.sleep(0.1)
    raise TimeoutError(f"no rendezvous store at {endpoint} after {timeout}s")


def _resumed(run_dir: Path) -> list[dict]:
    return [e for e in read_timeline(run_dir) if e["event"] == "resumed"]


def _first_to_exit(procs: list, timeout: float = 300) -> int:
    deadline = time.time() + timeout
    while time.time() < deadline:
        for i, p in enumerate(procs):
            if p.poll() is not None:
                return i
        time.sleep(0.1)
    raise TimeoutError("no agent exited")


def test_replacement_agent_joins_the_survivor_later(tmp_path, clean_digest, agents):
    spec = TrainingSpec(**BASE, faults=[{"kind": "kill_node", "rank": 1, "step": 150}])
    plan_path = prepare(spec, tmp_path)
    agents.extend(start_agent(plan_path, node, log_dir=tmp_path / "logs") for node in (0, 1))
    lost = _first_to_exit(agents)
    assert agents[lost].returncode != 0  # the fault SIGKILLed the agent of rank 1's node
    time.sleep(2)  # the replacement comes later, as a task retry does
    agents.append(start_agent(plan_path, lost, log_dir=tmp_path / "logs"))
    assert [agents[1 - lost].wait(timeout=300), agents[-1].wait(timeout=300)] == [0, 0]
    assert _resumed(tmp_path)
    assert evaluate(tmp_path)["weights_sha256"] == clean_digest


@pytest.mark.parametrize("database", ["sqlite", "postgres"])
def test_losing_rank_0s_node_costs_only_that_node_on_the_database_rendezvous(
    tmp_path, clean_digest, agents, database, request, monkeypatch
):
    """Rank 0's node (whichever joined first) is killed with its whole tree: its agent, its
    workers and rank 0's store of the round. The other agent lives on, restarts its worker
    and waits in the rendezvous until the replacement joins. On the embedded profile's
    SQLite file and on the distributed profile's PostgreSQL database alike."""
    if database == "postgres":
        monkeypatch.setenv("TRAINFLOW_STATE_DB", request.getfixturevalue("pg_url"))
    spec = TrainingSpec(**BASE, faults=[{"kind": "kill_node", "rank": 0, "step": 150}])
    plan_path = prepare(spec, tmp_path)
    rendezvous = json.loads(plan_path.read_text())["rendezvous"]
    assert rendezvous["backend"] == "trainflow-db"
    assert rendezvous["endpoint"].startswith("postgresql://" if database == "postgres" else "sqlite:///")
    agents.extend(start_agent(plan_path, node, log_dir=tmp_path / "logs") for node in (0, 1))
    lost = _first_to_exit(agents)
    survivor = agents[1 - lost]
    assert agents[lost].returncode != 0  # the fault SIGKILLed the agent tree of rank 0's node
    time.sleep(5)  # longer than the keep-alive window: the survivor must not give up
    assert survivor.poll() is None, "the survivor's agent failed with rank 0's node"
    agents.append(start_agent(plan_path, lost, log_dir=tmp_path / "logs"))
    assert [survivor.wait(timeout=300), agents[-1].wait(timeout=300)] == [0, 0]
    assert _resumed(tmp_path)
    assert evaluate(tmp_path)["weights_sha256"] == clean_digest


def test_c10d_store_host_loss_fails_the_survivor_too(tmp_path, clean_digest, agents):
    """The contrast: torch's own c10d rendezvous dies with the node that hosts it."""
    spec = TrainingSpec(**BASE, faults=[{"kind": "kill_node", "rank": 0, "step": 150}])
    plan_path = prepare(spec, tmp_path, rdzv_backend="c10d")
    agents.append(start_agent(plan_path, 0, log_dir=tmp_path / "logs"))
    _wait_for_store(json.loads(plan_path.read_text())["rendezvous"]["endpoint"])
    agents.append(start_agent(plan_path, 1, log_dir=tmp_path / "logs"))
    node0, node1 = agents
    assert node0.wait(timeout=300) != 0
    assert node1.wait(timeout=60) != 0  # no rendezvous left: it fails, to be replaced
    agents.extend(start_agent(plan_path, node, log_dir=tmp_path / "logs") for node in (0, 1))
    assert [p.wait(timeout=300) for p in agents[2:]] == [0, 0]
    assert evaluate(tmp_path)["weights_sha256"] == clean_digest
