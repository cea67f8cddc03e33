"""End to end with the S3 tier: the shared embedded stack with its checkpoints published to a
real S3 server (SeaweedFS on loopback), credentials only in an Airflow Connection. Then the
workspace loses its checkpoints (as a lost host would) and evaluate, cleared, reads the
checkpoint back from S3."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from trainflow.checkpoint.s3 import S3Store

pytestmark = pytest.mark.e2e
DAG = "train_digits"


def test_checkpoints_go_to_s3_and_evaluate_reads_them_back(stack, client, s3_server, run_to_end):
    conf = {
        "steps": 300,
        "checkpoint_interval": 100,
        "keep_last": 2,
        "tenant": "s3e2e",
        "store_uri": f"s3://{s3_server.bucket}/e2e",
    }
    run_id = "s3-digits-1"
    run_to_end(client, DAG, conf, run_id, timeout=600)

    pointer = client.xcom(DAG, run_id, "checkpoint_sync", "checkpoint")
    assert pointer["uri"] == f"s3://{s3_server.bucket}/e2e/s3e2e/{DAG}/{run_id}/step-00000300"
    store = S3Store(s3_server.client(), s3_server.bucket, "e2e", tenant="s3e2e", dag_id=DAG, run_id=run_id)
    # node 0 uploaded checkpoints while training, checkpoint_sync the final one; keep_last 2
    assert store.steps()[0] == 300 and len(store.steps()) <= 2
    assert store.read_manifest(300)["world_size"] == 2
    first = client.xcom(DAG, run_id, "evaluate", "metrics")

    # The workspace loses its checkpoints; evaluate, cleared, finds the store's copy.
    run_dir = Path(client.xcom(DAG, run_id, "provision", "run_dir"))
    shutil.rmtree(run_dir / "checkpoints")
    client.call(
        "POST",
        f"/api/v2/dags/{DAG}/clearTaskInstances",
        {
            "dry_run": False,
            "task_ids": ["evaluate"],
            "dag_run_id": run_id,
            "only_failed": False,
            "reset_dag_runs": True,
            "include_downstream": False,
        },
    )
    run = client.wait_run(DAG, run_id, timeout=300)
    assert run["state"] == "success"
    again = client.xcom(DAG, run_id, "evaluate", "metrics")
    assert again["weights_sha256"] == first["weights_sha256"] and again["step"] == 300
    log = client.task_log(DAG, run_id, "evaluate", try_number=2)
    assert "evaluating the store's step 300" in log

    # The secret never shows in XComs, the run's conf or the task logs.
    secret = s3_server.secret_key
    for task in ("checkpoint_sync", "evaluate", "provision"):
        assert secret not in client.task_log(DAG, run_id, task)
    assert secret not in json.dumps(client.run(DAG, run_id))
    assert secret not in json.dumps(pointer)
    # Nor anywhere on disk: every task log (node tasks too), the run's workspace (plan,
    # heartbeats, report, metrics, timeline) and trainflow's state database.
    leaked = [
        p
        for top in (stack.home / "logs", stack.trainflow_home)
        for p in top.rglob("*")
        if p.is_file() and secret.encode() in p.read_bytes()
    ]
    assert leaked == []
    # Nor in the training page's API answers (the run list and the run in full).
    import urllib.request

    for path in ("/trainflow/api/runs", f"/trainflow/api/runs/s3e2e/{DAG}/{run_id}"):
        req = urllib.request.Request(stack.url + path, headers={"Authorization": f"Bearer {client.token()}"})
        with urllib.request.urlopen(req, timeout=30) as resp:
            body = resp.read().decode()
        assert run_id in body and secret not in body, path
