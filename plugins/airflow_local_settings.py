"""Airflow cluster policies shipped with trainflow (Airflow puts the plugins folder on
``sys.path`` before importing ``airflow_local_settings``).

``task_instance_mutation_hook`` routes each node task of a training run to the queue of the
chip (and model) the run asked for in its conf — ``queue`` cannot be mapped per run with
``expand_kwargs`` (it fails at run time), and the DAG's static queue only knows the DAG's
default chip. It runs in the scheduler inside a transaction: no database access here.
"""

from __future__ import annotations

from typing import Any


def task_instance_mutation_hook(task_instance: Any, dag_run: Any = None) -> None:
    from trainflow.routing import node_queue

    queue = node_queue(task_instance.task_id, getattr(dag_run, "conf", None), getattr(task_instance, "queue", None))
    if queue is not None:
        task_instance.queue = queue
