"""Airflow provider metadata (entry point ``apache_airflow_provider``)."""

from __future__ import annotations

from trainflow import __version__


def get_provider_info() -> dict:
    """Return the provider description Airflow lists under ``airflow providers list``."""
    return {
        "package-name": "trainflow",
        "name": "trainflow",
        "description": "Distributed PyTorch training runs as Airflow DAGs: gang provisioning, "
        "per-node shard training on chip queues, heartbeat sensors, verified checkpoints.",
        "versions": [__version__],
        "operators": [
            {
                "integration-name": "trainflow",
                "python-modules": [
                    "operators.provision",
                    "operators.shard_train",
                    "operators.checkpoint_sync",
                    "operators.evaluate",
                    "operators.release",
                ],
            }
        ],
        "sensors": [{"integration-name": "trainflow", "python-modules": ["sensors.heartbeat"]}],
        "triggers": [{"integration-name": "trainflow", "python-modules": ["sensors.heartbeat"]}],
        "integrations": [
            {
                "integration-name": "trainflow",
                "external-doc-url": "https://example.invalid/trainflow",
                "tags": ["software"],
            }
        ],
    }
