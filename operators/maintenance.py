"""``retention``: the maintenance DAG's one task: trainflow's retention sweep, then
``airflow db clean`` where an admin granted it the metadata database."""

from __future__ import annotations

import os
from typing import Any

from airflow.sdk import BaseOperator

# The connection that grants the maintenance task Airflow's metadata database (tasks have no
# database access of their own in Airflow 3): extra ``{"sql_alchemy_conn": "<url>"}``. The
# embedded stack defines it; elsewhere an admin does, or runs `trainflow retention
# --airflow-db` from cron where the scheduler runs.
METADATA_CONN_ID = "trainflow_metadata_db"


class RetentionOperator(BaseOperator):
    """One retention pass (``trainflow.retention``); returns what it removed (an XCom)."""

    def __init__(self, *, dry_run: bool = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.dry_run = dry_run

    def execute(self, context) -> dict:
        import sys
        from pathlib import Path

        from airflow.sdk import Connection
        from airflow.sdk.exceptions import AirflowNotFoundException

        from operators._common import airflow_run_state
        from trainflow import retention
        from trainflow.cluster.allocator import Allocator
        from trainflow.workspace import default_root

        params = context.get("params") or {}
        overrides = {k: params.get(k) for k in ("workspace_days", "log_days", "airflow_days")}
        policy = retention.Retention.from_env(**overrides)
        dry_run = self.dry_run or bool(params.get("dry_run"))
        logs = Path(os.environ["AIRFLOW_HOME"]) / "logs" if os.environ.get("AIRFLOW_HOME") else None
        out = retention.sweep(workspaces=default_root(), logs=logs, policy=policy, dry_run=dry_run)
        if not dry_run:  # leases of runs deleted (or ended without release) free their nodes
            out["freed"] = Allocator().release_gone(airflow_run_state)
        self.log.info(
            "workspaces %s, logs %s, rotated %s, rows %s",
            out.get("workspaces"),
            out.get("logs"),
            out.get("rotated"),
            out.get("state"),
        )
        try:
            url = Connection.get(METADATA_CONN_ID).extra_dejson.get("sql_alchemy_conn")
        except AirflowNotFoundException:
            url = None
        if not url:
            self.log.warning(
                "no connection %r with extra sql_alchemy_conn: Airflow's metadata rows "
                "are not cleaned here (run `trainflow retention --airflow-db` where the "
                "scheduler runs)",
                METADATA_CONN_ID,
            )
            out["airflow_db_clean"] = None
            return out
        airflow = str(Path(sys.executable).parent / "airflow")
        # Never cut a run still in flight: not this one, not a training run older than the
        # bound (db clean cuts dag runs by their start; clean_airflow_db also asks the database).
        done = retention.clean_airflow_db(
            policy, url, airflow=airflow, dry_run=dry_run, keep_after=context["dag_run"].start_date.timestamp() - 1
        )
        self.log.info("%s → exit %d\n%s", " ".join(done["argv"][1:]), done["exit_code"], done["output"])
        if done["exit_code"] != 0:
            raise RuntimeError(f"airflow db clean failed with exit code {done['exit_code']}; see the log")
        out["airflow_db_clean"] = {"before": done["before"]}
        return out
