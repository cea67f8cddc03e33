"""``training_dag``: the one factory that builds every training DAG from a spec.

provision → shard_train[node] (mapped) → checkpoint_sync → evaluate, with
heartbeat_watch beside shard_train and the release teardown.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any, Mapping, Sequence

from airflow.sdk import DAG, Asset, ExceptionRetryPolicy, Param, RetryAction, RetryRule

from trainflow.spec import TrainingSpec, check_tenants, param_schema


def checkpoint_asset(dag_id: str) -> Asset:
    """The asset whose events announce new verified checkpoints of ``dag_id``."""
    return Asset(name=f"{dag_id}_checkpoint", uri=f"trainflow://checkpoints/{dag_id}")


# Node tasks: deterministic failures end the run at once; infrastructure failures
# (a killed or replaced node, a failed preflight, an agent that gave up) are retried
# after one second, so the gang is whole again quickly.
NODE_RETRY_POLICY = ExceptionRetryPolicy(
    rules=[
        RetryRule(
            exception=[
                "trainflow.errors.RunAbortedError",
                "trainflow.errors.SpecError",
                "trainflow.errors.ChipUnavailableError",
            ],
            action=RetryAction.FAIL,
            reason="deterministic failure: a retry cannot help",
        ),
        RetryRule(
            exception="trainflow.errors.TrainingError",
            action=RetryAction.RETRY,
            retry_delay=timedelta(seconds=1),
            reason="infrastructure failure: replace the node",
        ),
    ]
)


def training_dag(
    dag_id: str,
    *,
    defaults: Mapping[str, Any] | None = None,
    schedule: Any = None,
    description: str | None = None,
    tags: list[str] | None = None,
    max_active_runs: int = 4,
    node_pool: str = "embedded",
    tenants: Sequence[str] | None = None,
    allow_faults: bool = False,
) -> DAG:
    """Build a training DAG whose trigger form and REST conf are validated by the spec.

    Args:
        dag_id: the DAG id.
        defaults: per-DAG spec defaults (validated here, at parse time).
        schedule: an Airflow schedule (cron string, timetable, assets) or None.
        description, tags, max_active_runs: as for ``DAG``.
        node_pool: trainflow allocator pool the runs are admitted from.
        tenants: the tenants this DAG runs for (None: any). With Airflow granting access per
            DAG, one DAG per tenant (or group of tenants) makes DAG access tenant access: the
            trigger form offers only these, Airflow refuses any other in a conf, and
            provision checks again.
        allow_faults: runs of this DAG may carry a fault schedule (a rehearsal DAG). Off,
            a conf with faults fails provision, naming this switch and the deployment's
            ``TRAINFLOW_ALLOW_FAULTS``, before anything is allocated.
    """
    from operators.checkpoint_sync import CheckpointSyncOperator
    from operators.evaluate import EvaluateOperator
    from operators.provision import ProvisionOperator
    from operators.release import ReleaseOperator
    from operators.shard_train import ShardTrainOperator
    from sensors.heartbeat import HeartbeatSensor

    spec = TrainingSpec.from_mapping(dict(defaults or {}))
    tenants = check_tenants(tenants)
    params = {name: Param(**kw) for name, kw in param_schema(defaults, tenants).items()}
    with DAG(
        dag_id=dag_id,
        description=description or f"Train {spec.workload} with trainflow",
        schedule=schedule,
        start_date=datetime(2026, 1, 1),
        catchup=False,
        max_active_runs=max_active_runs,
        params=params,
        tags=["trainflow", spec.workload, *(tags or [])],
        default_args={"retries": 0},
        render_template_as_native_obj=False,
    ) as dag:
        provision = ProvisionOperator(
            task_id="provision",
            retries=2,
            retry_delay=timedelta(seconds=5),
            node_pool=node_pool,
            tenants=tenants,
            allow_faults=allow_faults,
        )
        shards = ShardTrainOperator.partial(
            task_id="shard_train",
            queue=spec.queue,
            retries=10,
            retry_delay=timedelta(seconds=2),
            retry_policy=NODE_RETRY_POLICY,
        ).expand_kwargs(provision.output)
        watch = HeartbeatSensor(task_id="heartbeat_watch", retries=0)
        sync = CheckpointSyncOperator(
            task_id="checkpoint_sync", retries=2, retry_delay=timedelta(seconds=2), outlets=[checkpoint_asset(dag_id)]
        )
        evaluate = EvaluateOperator(task_id="evaluate", retries=1, retry_delay=timedelta(seconds=2))
        release = ReleaseOperator(task_id="release")
        provision >> [shards, watch]
        shards >> sync >> evaluate >> release
        watch >> release
        release.as_teardown(setups=provision)
    return dag
