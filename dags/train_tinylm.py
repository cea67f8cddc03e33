"""Airflow DAG: Train a byte-level transformer LM on the Python standard library's own source."""

from operators.dag_factory import training_dag

DEFAULTS = {
    "workload": "tinylm",
    "nodes": 2,
    "steps": 1500,
    "batch_size": 16,
    "lr": 0.006,
    "checkpoint_interval": 500,
    "heartbeat_timeout": 120.0,
}

dag = training_dag(
    "train_tinylm",
    defaults=DEFAULTS,
    description="tiny byte-level LM, 2 nodes; evaluate targets ≥ 2× better bits/byte than unigram",
)
