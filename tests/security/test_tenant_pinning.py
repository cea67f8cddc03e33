"""A DAG may be pinned to its tenants (``training_dag(tenants=...)``). Airflow grants access
per DAG, so with one DAG per tenant a user who may trigger a DAG cannot run, be billed or be
shown as another tenant: the trigger form offers only the DAG's tenants, Airflow's conf
validation refuses any other, and provision checks again before anything is allocated."""

from __future__ import annotations

import pytest

from trainflow.errors import SpecError
from trainflow.spec import check_tenant, check_tenants, param_schema


def test_tenant_lists_are_checked_and_enforced():
    assert check_tenants(None) is None and check_tenants(["team-a", "team-b"]) == ("team-a", "team-b")
    for bad in ([], "team-a", ["Team A"], ["../x"]):
        with pytest.raises(SpecError):
            check_tenants(bad)
    check_tenant("anyone", None)
    check_tenant("team-a", ("team-a",))
    with pytest.raises(SpecError, match=r"invalid tenant='team-b': this DAG runs only for tenant\(s\) team-a"):
        check_tenant("team-b", ("team-a",))


def test_the_trigger_form_offers_only_the_dags_tenants():
    schema = param_schema({}, ["team-a", "team-b"])["tenant"]
    assert schema["enum"] == ["team-a", "team-b"] and schema["default"] == "team-a"
    assert "enum" not in param_schema({})["tenant"]


def test_airflow_and_provision_refuse_another_tenant(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINFLOW_HOME", str(tmp_path))
    from airflow.sdk import Param
    from airflow.sdk.exceptions import AirflowFailException, ParamValidationError

    from operators.dag_factory import training_dag

    dag = training_dag("team_a_train", tenants=["team-a"])
    tenant = dag.params.get_param("tenant")
    assert tenant.resolve("team-a") == "team-a"
    with pytest.raises(ParamValidationError):
        Param(tenant.value, **tenant.schema).resolve("team-b")  # Airflow refuses the conf at trigger
    provision = dag.get_task("provision")
    context = {"params": {**dag.params.dump(), "tenant": "team-b"}, "run_id": "r1"}
    with pytest.raises(AirflowFailException, match="this DAG runs only for tenant"):
        provision._validate(context)  # and provision, were a conf to bypass the form
    assert not (tmp_path / "runs").exists()  # nothing written
