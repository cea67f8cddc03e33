"""The Airflow stacks of the end-to-end tier.

One embedded stack (api-server, scheduler, dag-processor, triggerer; SQLite + LocalExecutor,
a pool of 4 nodes, checkpoints publishable to the session's S3 server) is shared by every
test file that asks for ``stack``/``client``: runs stay apart by run id and tenant, and each
file leaves no run active behind it. Files whose tests need other settings or restart the
whole stack (elastic gangs' pool of 3, the distributed stack, the soak) own theirs.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import pytest

from trainflow.launch.local import free_port
from trainflow.stack import EmbeddedStack

ACTIVE_RUN_STATES = ("queued", "running")


@pytest.fixture(scope="module")
def stack(shared_stack):
    """The shared stack, started again if this worker stopped it once the e2e files it had
    were done (``tests/conftest.py`` stops it before a unit or integration test)."""
    if not any(shared_stack.pid(c) for c in shared_stack.components):
        shared_stack.up(timeout=240)
    return shared_stack


@pytest.fixture(scope="session")
def shared_stack(request, tmp_path_factory, s3_server):
    root = tmp_path_factory.mktemp("stack")
    # Users' programs may run from the repository's examples (tests/e2e/test_programs.py).
    examples = Path(__file__).resolve().parents[2] / "examples"
    s = EmbeddedStack(
        home=root / "airflow",
        trainflow_home=root / "trainflow",
        port=free_port(),
        allow_faults=True,
        extra_env={
            "AIRFLOW_CONN_TRAINFLOW_S3": s3_server.airflow_connection(),
            "TRAINFLOW_PROGRAM_ROOTS": str(examples),
        },
    )
    request.config.trainflow_idle_stacks = [*getattr(request.config, "trainflow_idle_stacks", []), s]
    try:
        s.up(timeout=240)
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def client(stack):
    """A REST client of the shared stack; at the end of the file, every run the file left
    active is cancelled (as ``trainflow cancel`` does) so the next file finds the pool free."""
    client = stack.client()
    yield client
    cancel_active_runs(client)


def cancel_active_runs(client, timeout: float = 180) -> None:
    from trainflow.cli_runs import cmd_cancel

    runs = client.call("GET", "/api/v2/dags/~/dagRuns?limit=100&state=queued&state=running")["dag_runs"]
    for run in runs:
        cmd_cancel(client, argparse.Namespace(dag=run["dag_id"], run_id=run["dag_run_id"]))
    for run in runs:
        client.wait_run(run["dag_id"], run["dag_run_id"], timeout=timeout)


@pytest.fixture(scope="session")
def wait_training():
    """``wait_training(client, dag_id, run_id, past_step, timeout=300)``: the run's workspace
    once every rank of its 2-node gang has reported a step past ``past_step``."""
    return _wait_training


def _wait_training(client, dag_id: str, run_id: str, past_step: int, timeout: float = 300, ranks: int = 2) -> str:
    import time

    from trainflow.heartbeat import read_all

    deadline = time.time() + timeout
    while time.time() < deadline:
        states = {t["task_id"]: t["state"] for t in client.task_instances(dag_id, run_id)}
        if states.get("provision") == "success":
            run_dir = client.xcom(dag_id, run_id, "provision", "run_dir")
            beats = read_all(f"{run_dir}/heartbeats")
            if len(beats) == ranks and min(b["step"] for b in beats.values()) > past_step:
                return run_dir
        time.sleep(0.3)
    raise AssertionError(f"{dag_id}/{run_id}: its {ranks} ranks never trained past step {past_step} within {timeout} s")


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    """``reference(conf)``: the final ``weights_sha256`` of a clean run of ``train_digits``
    with ``conf`` (no faults), trained by a local gang — the launcher the DAG's node tasks
    run — without Airflow's tasks around it; computed once per conf in a session."""
    import json

    from bench.soak import clean_weights

    known: dict[str, str] = {}

    def weights(conf: dict) -> str:
        conf = {k: v for k, v in conf.items() if k != "tenant"}  # who trains does not change what
        key = json.dumps(conf, sort_keys=True)
        if key not in known:
            known[key] = clean_weights({**conf, "tenant": "reference"}, tmp_path_factory.mktemp("reference"))
        return known[key]

    return weights


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


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    """Headless Chromium (``trainflow.testing.browser``); the test skips, saying why, where
    Debian's chromium and chromium-driver are missing (scripts/test installs them)."""
    from trainflow.testing import browser as tools

    if not tools.available():
        message = "needs Debian's chromium and chromium-driver (scripts/test installs them)"
        if os.environ.get("CI"):
            pytest.fail(f"{message}; CI runs every tier", pytrace=False)
        pytest.skip(message)
    driver = tools.chrome(tmp_path_factory.mktemp("chromium"))
    try:
        yield driver
    finally:
        driver.quit()
