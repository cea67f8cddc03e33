"""Airflow DAG: Train a CNN on scikit-learn's digits with a 2-node gang (trigger from the UI or REST)."""

from operators.dag_factory import training_dag

DEFAULTS = {"workload": "digits", "nodes": 2, "steps": 300, "batch_size": 32, "lr": 0.003, "checkpoint_interval": 50}

dag = training_dag(
    "train_digits",
    defaults=DEFAULTS,
    description="digits CNN, 2 nodes × 1 rank, DDP on gloo; evaluate targets accuracy ≥ 0.95",
)
