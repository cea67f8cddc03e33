"""Which Airflow queue a task of a training run belongs on (pure)."""

from __future__ import annotations

import re
from typing import Any, Callable, Mapping

from trainflow.chips.registry import FAMILIES, family_of_queue, queue_for

NODE_TASKS = ("shard_train",)
_MODEL = re.compile(r"^[a-z0-9][a-z0-9-]{0,30}$")


def node_queue(task_id: str, conf: Mapping[str, Any] | None, current: str | None = None) -> str | None:
    """The chip queue for a node task of a run, or None (leave the task's queue).

    The run's conf may name the chip and its model; what it leaves out comes from the
    task's current queue (the DAG's default chip, ``<family>-<model>``). Invalid values
    are left for provision to refuse with the field and the fix.
    """
    if task_id not in NODE_TASKS or not conf or not ({"chip", "chip_model"} & set(conf)):
        return None
    base = family_of_queue(current) if current else None
    chip = conf.get("chip", base)
    if not isinstance(chip, str) or chip not in FAMILIES:
        return None
    model = conf.get("chip_model")
    if model is None and chip == base and current and current != "cpu":
        model = current[len(chip) + 1 :]  # the DAG's own model of the same family
    if model is not None and (not isinstance(model, str) or (model and not _MODEL.match(model))):
        return None
    return queue_for(chip, model or None)


def host_queue(queue: str, host: str) -> str:
    """The queue of chip queue ``queue`` on one host: ``<queue>@<host>`` (the host's worker
    consumes it beside ``queue``)."""
    return f"{queue.split('@', 1)[0]}@{host}"


def placed_queue(
    task_id: str,
    dag_id: str,
    run_id: str,
    map_index: int | None,
    try_number: int,
    queue: str,
    route: Callable[[str, str, int, int], str | None],
) -> str | None:
    """The host queue a try of a node task goes to, or None (it keeps ``queue``).

    Args:
        route: ``Allocator.route``: the host of (dag id, run id, node slot, try), or None
            when the slot holds no host.
    """
    if task_id not in NODE_TASKS or map_index is None or map_index < 0:
        return None
    host = route(dag_id, run_id, map_index, try_number)
    return None if host is None else host_queue(queue, host)
