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
        run_dir = context["ti"].xcom_pull(task_ids="provision", key="run_dir")
        freed = Allocator().release(key, completed=self._completed(run_dir))
        self.log.info("lease %s %s", key, "released" if freed else "was not held")
        if run_dir:  # the training page shows the run's nodes as given back
            import time
            from pathlib import Path

            from trainflow.workspace import write_json_atomic

            nodes = Path(run_dir) / "nodes"
            if nodes.is_dir():
                write_json_atomic(nodes / "released.json", {"time": time.time(), "freed": freed})
        return freed

    def _completed(self, run_dir: str | None):
        """``(history scope, steps)`` of a run that trained to the end (its time then
        teaches the next runs' runtime estimates), else None."""
        from pathlib import Path

        from operators.provision import history_scope
        from trainflow.spec import TrainingSpec
        from trainflow.workspace import completed

        if not run_dir or not completed(run_dir):
            return None
        try:
            spec = TrainingSpec.from_json((Path(run_dir) / "spec.json").read_text())
        except (OSError, ValueError):
            return None
        return history_scope(self.dag_id, spec), spec.steps
