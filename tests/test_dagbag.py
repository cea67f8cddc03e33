"""The DAG folder parses without errors; every training DAG has the expected shape."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

DAGS = Path(__file__).resolve().parents[1] / "dags"
TRAINING = ["train_digits", "train_tinylm", "retrain_digits_nightly"]


@pytest.fixture(scope="module")
def dagbag(tmp_path_factory):
    os.environ.setdefault("AIRFLOW_HOME", str(tmp_path_factory.mktemp("airflow")))
    from airflow.dag_processing.dagbag import DagBag

    return DagBag(dag_folder=str(DAGS))


def test_no_import_errors(dagbag):
    assert dagbag.import_errors == {}
    assert set(TRAINING) | {"checkpoint_audit"} <= set(dagbag.dag_ids)


@pytest.mark.parametrize("dag_id", TRAINING)
def test_training_dag_shape(dagbag, dag_id):
    dag = dagbag.dags[dag_id]
    assert "trainflow" in dag.tags
    assert set(dag.task_ids) == {
        "provision",
        "shard_train",
        "heartbeat_watch",
        "checkpoint_sync",
        "evaluate",
        "release",
    }
    t = dag.task_dict
    assert t["shard_train"].retries >= 1 and t["provision"].retries >= 1
    assert t["shard_train"].upstream_task_ids == {"provision"}
    assert t["heartbeat_watch"].upstream_task_ids == {"provision"}
    assert t["checkpoint_sync"].upstream_task_ids == {"shard_train"}
    assert t["evaluate"].upstream_task_ids == {"checkpoint_sync"}
    assert t["release"].is_teardown and t["provision"].is_setup
    assert t["shard_train"].queue == "cpu"
    assert {task.pool for task in dag.tasks} == {"default_pool"}
    assert [o.uri for o in t["checkpoint_sync"].outlets] == [f"trainflow://checkpoints/{dag_id}"]
    assert dag.catchup is False


def test_scheduled_retrain_is_cron_without_catchup(dagbag):
    dag = dagbag.dags["retrain_digits_nightly"]
    assert dag.timetable.expression == "0 2 * * *"
    assert dag.catchup is False and dag.max_active_runs == 1


def test_params_are_generated_from_the_spec(dagbag):
    from trainflow.spec import TrainingSpec

    params = dagbag.dags["train_tinylm"].params
    assert set(params.keys()) == set(TrainingSpec.__dataclass_fields__)
    assert params["workload"] == "tinylm"
    schema = params.get_param("nodes").schema
    assert schema["minimum"] == 1 and schema["type"] == ["string", "integer"] and schema["section"] == "Gang"
    params.get_param("nodes").resolve("2:4")  # an elastic range passes the form
    params.get_param("nodes").resolve(3)  # REST may send a number


def test_the_trigger_forms_defaults_are_a_valid_run(dagbag):
    """The form's defaults pass Airflow's own validation as they are (nothing required is
    left empty), and optional strings may be null or absent."""
    from trainflow.spec import OPTIONAL_STRINGS, TrainingSpec

    params = dagbag.dags["train_digits"].params
    values = params.validate()
    for name in OPTIONAL_STRINGS:
        assert values[name] is None and params.get_param(name).schema["type"] == ["null", "string"]
        params.get_param(name).resolve(None)
    spec = TrainingSpec.from_mapping(values)
    assert spec.nodes == 2 and spec.store_uri == "" and spec.chip_model == ""


def test_trigger_form_rejects_bad_values(dagbag):
    from airflow.sdk.exceptions import ParamValidationError

    params = dagbag.dags["train_digits"].params
    for key, bad in [
        ("nodes", 0),
        ("nodes", "0"),
        ("nodes", "0:2"),
        ("nodes", "2-4"),
        ("nodes", "2\n3"),
        ("chip", "tpu"),
        ("lr", 0),
        ("tenant", "../x"),
        ("steps", -1),
    ]:
        p = params.get_param(key)
        with pytest.raises(ParamValidationError):
            p.resolve(bad)


def test_heartbeat_trigger_serialization_round_trip():
    from sensors.heartbeat import HeartbeatTrigger

    trig = HeartbeatTrigger(
        run_dir="/x", world_size=4, timeout=9.0, startup_timeout=60.0, started_at=123.0, poll_interval=0.5
    )
    path, kwargs = trig.serialize()
    assert path == "sensors.heartbeat.HeartbeatTrigger"
    assert HeartbeatTrigger(**kwargs).serialize() == (path, kwargs)


def test_operator_fields_survive_dag_serialization(dagbag):
    from airflow.serialization.serialized_objects import DagSerialization

    dag = dagbag.dags["train_digits"]
    round_trip = DagSerialization.from_dict(DagSerialization.to_dict(dag))
    assert list(round_trip.task_dict["heartbeat_watch"].template_fields) == ["run_dir"]
    assert list(round_trip.task_dict["shard_train"].template_fields) == ["node", "plan_path"]
    assert round_trip.task_dict["release"].is_teardown
    assert round_trip.task_dict["shard_train"].queue == "cpu"
    assert set(round_trip.params.keys()) == set(dag.params.keys())


def test_maintenance_dag_sweeps_hourly_one_run_at_a_time(dagbag):
    from operators.maintenance import RetentionOperator

    dag = dagbag.dags["trainflow_maintenance"]
    assert dag.timetable.expression in ("@hourly", "0 * * * *") and dag.catchup is False and dag.max_active_runs == 1
    (task,) = dag.tasks
    assert isinstance(task, RetentionOperator) and task.retries == 1
    assert dag.params.get_param("airflow_days").resolve(0) == 0
    with pytest.raises(Exception):
        dag.params.get_param("airflow_days").resolve(-1)


def test_provision_reads_the_run_history_once_per_attempt(monkeypatch):
    """The admission request, its deferral and the slot leases share one estimate."""
    from operators.provision import ProvisionOperator
    from trainflow.cluster import allocator
    from trainflow.spec import TrainingSpec

    calls = []
    monkeypatch.setattr(allocator.Allocator, "__init__", lambda self, *a, **k: None)
    monkeypatch.setattr(allocator.Allocator, "estimate", lambda self, scope, steps: calls.append(scope) or 42.0)
    op = ProvisionOperator(task_id="provision", node_pool="gpu")
    spec = TrainingSpec.from_mapping({"workload": "digits", "steps": 100, "nodes": 2})
    first = op._request_kwargs(spec, "default/dag/run-1")
    first["nodes"] = 99  # a caller's change does not leak into the memo
    again = op._request_kwargs(spec, "default/dag/run-1")
    assert len(calls) == 1 and again["estimate"] == 42.0 and again["nodes"] == 2
    op._request_kwargs(spec, "default/dag/run-2")
    assert len(calls) == 2
