"""Airflow DAG: Scheduled retrain: the digits model every night at 02:00 UTC (no catch-up)."""

from operators.dag_factory import training_dag

dag = training_dag(
    "retrain_digits_nightly",
    defaults={"workload": "digits", "nodes": 2, "steps": 300, "checkpoint_interval": 100},
    schedule="0 2 * * *",
    description="nightly retrain of the digits CNN",
    tags=["scheduled"],
    max_active_runs=1,
)
