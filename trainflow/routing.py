"""Which Airflow queue a task of a training run belongs on (pure)."""

from __future__ import annotations

from typing import Any, Mapping

from trainflow.chips.registry import FAMILIES, queue_for

NODE_TASKS = ("shard_train",)


def node_queue(task_id: str, conf: Mapping[str, Any] | None) -> str | None:
    """The chip queue for a node task of a run whose conf names a chip, else None
    (leave the DAG's queue). Unknown chips are left to provision to refuse."""
    if task_id not in NODE_TASKS or not conf:
        return None
    chip = conf.get("chip")
    if not isinstance(chip, str) or chip not in FAMILIES:
        return None
    return queue_for(chip)
