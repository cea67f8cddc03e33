"""Fault injection is a privileged rehearsal: a training DAG refuses a fault schedule unless
it opts in (``training_dag(..., allow_faults=True)``) or the deployment allows it
(``TRAINFLOW_ALLOW_FAULTS``), naming both, before anything is allocated; and an injected
fault leaves no shared state behind it (host cordons, pool capacity)."""

from __future__ import annotations

import pytest

from trainflow.errors import SpecError
from trainflow.faults import ALLOW_FAULTS_ENV, check_allowed, parse_faults

KILL = [{"kind": "kill_rank", "rank": 1, "step": 10}]


@pytest.mark.parametrize(
    "dag_allows, env, allowed",
    [
        (False, {}, False),
        (False, {ALLOW_FAULTS_ENV: "0"}, False),
        (True, {}, True),
        (False, {ALLOW_FAULTS_ENV: "1"}, True),
        (False, {ALLOW_FAULTS_ENV: "true"}, True),
    ],
    ids=["default", "env-off", "dag", "env-1", "env-true"],
)
def test_a_fault_schedule_needs_the_dag_or_the_deployment(dag_allows, env, allowed):
    faults = parse_faults(KILL, world_size=2, steps=20)
    check_allowed((), dag_allows=False, env={})  # no faults: nothing to allow
    if allowed:
        check_allowed(faults, dag_allows=dag_allows, env=env)
        return
    with pytest.raises(SpecError, match="allow_faults=True.*TRAINFLOW_ALLOW_FAULTS=1") as exc:
        check_allowed(faults, dag_allows=dag_allows, env=env)
    assert exc.value.field == "faults"


def test_provision_refuses_faults_unless_the_dag_opts_in(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINFLOW_HOME", str(tmp_path))
    monkeypatch.delenv(ALLOW_FAULTS_ENV, raising=False)
    from airflow.sdk.exceptions import AirflowFailException

    from operators.dag_factory import training_dag

    context = {
        "params": {**training_dag("plain").params.dump(), "faults": KILL, "steps": 20, "checkpoint_interval": 10},
        "run_id": "r1",
    }
    with pytest.raises(AirflowFailException, match="invalid faults.*allow_faults=True"):
        training_dag("plain").get_task("provision")._validate(context)
    assert not (tmp_path / "runs").exists() and not (tmp_path / "state.db").exists()  # nothing allocated
    spec, _, _ = training_dag("rehearsal", allow_faults=True).get_task("provision")._validate(context)
    assert spec.faults[0].kind.value == "kill_rank"
    monkeypatch.setenv(ALLOW_FAULTS_ENV, "1")  # a rehearsal deployment: every DAG
    spec, _, _ = training_dag("plain").get_task("provision")._validate(context)
    assert spec.faults


def test_an_injected_node_loss_gives_the_capacity_back_when_the_run_releases(tmp_path):
    """``lose_node`` with seconds 0 takes the node out of the pool for the run's life only."""
    import math

    from trainflow.cluster.allocator import Allocator

    allocator = Allocator(tmp_path / "state.db")
    allocator.set_pool("p", 4)
    allocator.request(run_key="t/d/r", tenant="t", pool="p", nodes=2, ttl=600)
    allocator.lose_node("t/d/r", until=math.inf, reason="lose_node fault at step 5 (rank 1)")
    assert allocator.offline("p") == 1
    allocator.release("t/d/r")
    assert allocator.offline("p") == 0
