"""Airflow DAG: trainflow's housekeeping, hourly: finished runs' old workspaces, old task
logs, component logs past their size, stale rows in trainflow's tables, and Airflow's own old
metadata rows (``airflow db clean``). Bounds: ``TRAINFLOW_RETAIN_*`` (docs/guides/operations.md)."""

from datetime import datetime, timedelta

from airflow.sdk import DAG, Param

from operators.maintenance import RetentionOperator

with DAG(
    dag_id="trainflow_maintenance",
    schedule="@hourly",
    start_date=datetime(2026, 1, 1),
    catchup=False,
    max_active_runs=1,
    tags=["trainflow", "maintenance"],
    description="retention: nothing trainflow or Airflow keeps grows without bound",
    # A manual run may use shorter bounds (null: the TRAINFLOW_RETAIN_* / default ones).
    params={
        "workspace_days": Param(
            None, type=["null", "number"], minimum=0, description="keep finished runs' workspaces this many days"
        ),
        "log_days": Param(None, type=["null", "number"], minimum=0, description="keep task logs this many days"),
        "airflow_days": Param(
            None, type=["null", "number"], minimum=0, description="keep Airflow's metadata rows this many days"
        ),
        "dry_run": Param(False, type="boolean", description="report what would go; delete nothing"),
    },
):
    RetentionOperator(
        task_id="retention", retries=1, retry_delay=timedelta(minutes=5), execution_timeout=timedelta(hours=1)
    )
