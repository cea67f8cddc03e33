"""Lost nodes and late joiners on real gangs (no Airflow) with the agent's fast rendezvous
pace: a replacement agent started later (as a task retry is) joins the survivors, and the
loss of the node hosting the c10d store fails the survivor fast so that both are replaced;
either way the run ends with the same weights as a clean run."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import pytest

from trainflow.launch.local import kill_tree, prepare, run_local, start_agent
from trainflow.spec import TrainingSpec
from trainflow.timeline import read as read_timeline
from trainflow.worker.evaluate import evaluate

BASE = dict(workload="digits", nodes=2, steps=240, batch_size=16, checkpoint_interval=20,
            keep_last=3, seed=7)


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


@pytest.fixture
def agents():
    """Agents a test starts (appended to this list), their trees killed at the end."""
    procs = []
    yield procs
    for p in procs:
        if p.poll() is None:
            kill_tree(p)


def _start_gang_with_store_on_node_0(spec: TrainingSpec, run_dir: Path, agents: list):
    """Start node 0's agent, then node 1's once node 0 hosts the store (locally both could)."""
    plan_path = prepare(spec, run_dir)
    agents.append(start_agent(plan_path, 0, log_dir=run_dir / "logs"))
    _wait_for_store(json.loads(plan_path.read_text())["rendezvous"]["endpoint"])
    agents.append(start_agent(plan_path, 1, log_dir=run_dir / "logs"))
    return plan_path


def _resumed(run_dir: Path) -> list[dict]:
    return [e for e in read_timeline(run_dir) if e["event"] == "resumed"]


def test_replacement_agent_joins_the_survivor_later(tmp_path, clean_digest, agents):
    spec = TrainingSpec(**BASE, faults=[{"kind": "kill_node", "rank": 1, "step": 150}])
    plan_path = _start_gang_with_store_on_node_0(spec, tmp_path, agents)
    node0, node1 = agents
    assert node1.wait(timeout=300) != 0  # the fault SIGKILLed node 1's agent
    time.sleep(2)  # the replacement comes later, as a task retry does
    agents.append(start_agent(plan_path, 1, log_dir=tmp_path / "logs"))
    assert [node0.wait(timeout=300), agents[-1].wait(timeout=300)] == [0, 0]
    assert _resumed(tmp_path)
    assert evaluate(tmp_path)["weights_sha256"] == clean_digest


def test_losing_the_store_host_fails_the_survivor_fast_and_both_are_replaced(tmp_path, clean_digest, agents):
    spec = TrainingSpec(**BASE, faults=[{"kind": "kill_node", "rank": 0, "step": 150}])
    plan_path = _start_gang_with_store_on_node_0(spec, tmp_path, agents)
    node0, node1 = agents
    assert node0.wait(timeout=300) != 0  # the fault SIGKILLed node 0's agent and its store
    lost = time.time()
    assert node1.wait(timeout=60) != 0  # no rendezvous left: it fails, to be replaced
    assert time.time() - lost < 30
    agents.extend(start_agent(plan_path, node, log_dir=tmp_path / "logs") for node in (0, 1))
    assert [p.wait(timeout=300) for p in agents[2:]] == [0, 0]
    assert _resumed(tmp_path)
    assert evaluate(tmp_path)["weights_sha256"] == clean_digest
