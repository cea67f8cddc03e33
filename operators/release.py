"""``release``: the teardown that frees the run's allocation whatever happened upstream."""

from __future__ import annotations

from typing import Any

from airflow.sdk import BaseOperator


class ReleaseOperator(BaseOperator):
    """Release the run's lease in trainflow's allocator (idempotent)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)

    def execute(self, context) -> bool:
        from trainflow.cluster.allocator import Allocator

        tenant = context["params"].get("tenant", "default")
        key = f"{tenant}/{self.dag_id}/{context['run_id']}"
        freed = Allocator().release(key)
        self.log.info("lease %s %s", key, "released" if freed else "was not held")
        run_dir = context["ti"].xcom_pull(task_ids="provision", key="run_dir")
        if run_dir:  # the training page shows the run's nodes as given back
            import time
            from pathlib import Path

            from trainflow.workspace import write_json_atomic

            nodes = Path(run_dir) / "nodes"
            if nodes.is_dir():
                write_json_atomic(nodes / "released.json", {"time": time.time(), "freed": freed})
        return freed
