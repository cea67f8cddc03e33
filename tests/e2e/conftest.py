"""A real embedded stack (api-server, scheduler, dag-processor, triggerer) per test module."""

from __future__ import annotations

import pytest

from trainflow.launch.local import free_port
from trainflow.stack import EmbeddedStack


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    root = tmp_path_factory.mktemp("stack")
    s = EmbeddedStack(home=root / "airflow", trainflow_home=root / "trainflow", port=free_port())
    try:
        s.up(timeout=240)
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def client(stack):
    return stack.client()


@pytest.fixture(scope="session")
def run_to_end():
    """``run_to_end(client, dag_id, conf, run_id, timeout)``, see ``_run_to_end``."""
    return _run_to_end


def _run_to_end(client, dag_id: str, conf: dict, run_id: str, timeout: float) -> dict:
    """Unpause, trigger ``run_id`` with ``conf``, wait; assert success (naming the task
    states otherwise); return the run."""
    client.wait_for_dag(dag_id, timeout=180)
    client.unpause(dag_id)
    client.trigger(dag_id, conf, run_id=run_id)
    run = client.wait_run(dag_id, run_id, timeout=timeout)
    states = {(t["task_id"], t["map_index"]): t["state"] for t in client.task_instances(dag_id, run_id)}
    assert run["state"] == "success", states
    return run
