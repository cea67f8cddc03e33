"""The CeleryExecutor with trainflow's host placement.

A gang admitted from a pool of registered hosts (``trainflow worker --pool P``) is placed on
particular hosts at admission (fewest racks, best fit: ``trainflow.sched.capacity.place``).
This executor sends each try of a node task to its slot's host: the queue ``<chip
queue>@<host>``, which that host's ``trainflow worker`` consumes beside its chip queue.
Routing happens when a try is queued, not when the task instance is created (Airflow's
``task_instance_mutation_hook`` is not applied again to retries), so a retry after a failure
moves to a free healthy host of the pool (``Allocator.route``) and a preempted run's
re-admitted gang goes to its new hosts. Every other task keeps its queue.

Set ``[core] executor = executors.placement.PlacementCeleryExecutor`` (the distributed
profile of ``trainflow.stack`` does). If trainflow's database cannot be read, the try keeps
its chip queue and the failure is logged: the run goes on, placed by Celery.
"""

from __future__ import annotations

from collections.abc import Sequence

from airflow.providers.celery.executors.celery_executor import CeleryExecutor


class PlacementCeleryExecutor(CeleryExecutor):
    """CeleryExecutor that routes node tasks to the hosts trainflow placed them on."""

    _allocator = None

    def _process_workloads(self, workload_items: Sequence) -> None:
        from airflow.executors.workloads import ExecuteTask

        for workload in workload_items:
            if isinstance(workload, ExecuteTask):
                self._route(workload.ti)
        super()._process_workloads(workload_items)

    def _route(self, ti) -> None:
        from trainflow.routing import placed_queue

        try:
            if self._allocator is None:
                from trainflow.cluster.allocator import Allocator

                self._allocator = Allocator()
            queue = placed_queue(
                ti.task_id, ti.dag_id, ti.run_id, ti.map_index, ti.try_number, ti.queue, self._allocator.route
            )
        except Exception:  # noqa: BLE001 - never lose a task over placement: Celery places it
            self.log.exception("placement of %s failed; it keeps queue %s", ti.key, ti.queue)
            return
        if queue is not None and queue != ti.queue:
            self.log.info("%s try %d goes to %s (placed by trainflow)", ti.key, ti.try_number, queue)
            ti.queue = queue
