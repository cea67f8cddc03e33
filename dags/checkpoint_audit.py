"""Runs whenever a training DAG publishes a checkpoint: re-verifies it from its manifest.

An example of a DAG scheduled on trainflow's checkpoint assets (e.g. to export or deploy
the newest model).
"""

from datetime import datetime

from airflow.sdk import DAG, task

from operators.dag_factory import checkpoint_asset

with DAG(
    dag_id="checkpoint_audit",
    schedule=(
        checkpoint_asset("train_digits") | checkpoint_asset("train_tinylm") | checkpoint_asset("retrain_digits_nightly")
    ),
    start_date=datetime(2026, 1, 1),
    catchup=False,
    tags=["trainflow", "assets"],
    description="re-verify every newly published checkpoint",
):

    @task(retries=1)
    def audit(triggering_asset_events=None) -> list[dict]:
        from trainflow.checkpoint.manifest import verify

        checked = []
        for asset, events in (triggering_asset_events or {}).items():
            for event in events:
                path = event.extra["path"]
                ref = verify(path)
                if ref is None or ref.manifest_sha256 != event.extra["manifest_sha256"]:
                    raise ValueError(f"published checkpoint {path} of {asset} does not verify")
                checked.append({"path": path, "step": ref.step, "bytes": ref.bytes})
        return checked

    audit()
