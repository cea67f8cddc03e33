"""End to end on the real embedded stack: REST trigger → gang training → checkpoint →
evaluation, plus refused input. Marked ``e2e``: it starts real Airflow processes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainflow.checkpoint import manifest
from trainflow.cluster.allocator import Allocator
from trainflow.rest import RestError

pytestmark = pytest.mark.e2e
DAG = "train_digits"


@pytest.fixture(scope="module")
def finished_run(client, stack):
    client.wait_for_dag(DAG, timeout=120)
    client.wait_for_dag("checkpoint_audit", timeout=120)
    client.unpause(DAG)
    client.unpause("checkpoint_audit")
    conf = {"steps": 300, "checkpoint_interval": 100, "keep_last": 2, "tenant": "e2e"}
    run_id = client.trigger(DAG, conf, run_id="e2e-digits-1")["dag_run_id"]
    run = client.wait_run(DAG, run_id, timeout=600)
    return run_id, run


def test_train_digits_over_rest(client, stack, finished_run):
    run_id, run = finished_run
    states = {(t["task_id"], t["map_index"]): t["state"] for t in client.task_instances(DAG, run_id)}
    assert run["state"] == "success", states
    assert states[("shard_train", 0)] == states[("shard_train", 1)] == "success"
    assert states[("heartbeat_watch", -1)] == "success"

    metrics = client.xcom(DAG, run_id, "evaluate", "metrics")
    assert metrics["accuracy"] >= 0.95 and metrics["target_met"] is True
    assert metrics["step"] == 300

    pointer = client.xcom(DAG, run_id, "checkpoint_sync", "checkpoint")
    assert pointer["verified"] and pointer["step"] == 300 and pointer["world_size"] == 2
    ref = manifest.verify(Path(pointer["path"]))
    assert ref is not None and ref.manifest_sha256 == pointer["manifest_sha256"]
    assert client.state_store(DAG, run_id, "checkpoint_sync", "checkpoint")["step"] == 300

    run_dir = Path(client.xcom(DAG, run_id, "provision", "run_dir"))
    assert run_dir == stack.trainflow_home / "runs" / "e2e" / DAG / run_id
    assert len(manifest.list_checkpoints(run_dir / "checkpoints")) == 2  # keep_last
    report = json.loads((run_dir / "report.json").read_text())
    assert report["metrics"]["weights_sha256"] == metrics["weights_sha256"]
    assert set(report["ranks"]) == {"0", "1"}
    assert (run_dir / "progress.png").read_bytes()[:4] == b"\x89PNG"
    assert report["plots"]["progress"] == str(run_dir / "progress.png")
    assert Allocator(stack.trainflow_home / "state.db").leases() == []  # released


def test_checkpoint_asset_schedules_the_audit_dag(client, finished_run):
    """The run's published checkpoint is re-verified by the asset-scheduled audit DAG (on the
    shared stack one audit run may also take the events other files' runs published)."""
    import time

    run_id, _ = finished_run
    mine: list[dict] = []
    deadline = time.time() + 120
    while time.time() < deadline and not mine:
        runs = client.runs("checkpoint_audit")
        done = [r for r in runs if r["state"] in ("success", "failed")]
        assert all(r["state"] == "success" for r in done), done
        for r in done:
            mine += [
                c for c in client.xcom("checkpoint_audit", r["dag_run_id"], "audit") or [] if f"/{run_id}/" in c["path"]
            ]
        time.sleep(1)
    assert mine and mine[0]["step"] == 300, mine


@pytest.mark.parametrize(
    "conf, field",
    [
        ({"nodes": 0}, "nodes"),
        ({"chip": "tpu"}, "chip"),
        ({"tenant": "../etc"}, "tenant"),
        ({"workload": "nosuch"}, "workload"),
        ({"lr": 0}, "lr"),
        ({"steps": 0}, "steps"),
    ],
)
def test_rest_refuses_bad_conf_naming_the_field(client, conf, field):
    client.wait_for_dag(DAG)
    with pytest.raises(RestError) as info:
        client.trigger(DAG, conf)
    assert info.value.status == 400
    assert f"param {field}" in str(info.value.detail)


def test_cross_field_errors_fail_provision_without_retry(client, stack):
    client.unpause(DAG)
    run_id = client.trigger(DAG, {"steps": 10, "checkpoint_interval": 50, "tenant": "bad"}, run_id="e2e-bad-1")[
        "dag_run_id"
    ]
    run = client.wait_run(DAG, run_id, timeout=180)
    assert run["state"] == "failed"
    tis = {t["task_id"]: t for t in client.task_instances(DAG, run_id) if t["map_index"] == -1}
    assert tis["provision"]["state"] == "failed" and tis["provision"]["try_number"] == 1
    log = client.task_log(DAG, run_id, "provision", 1)
    assert "invalid checkpoint_interval=50: must be at most steps (10)" in log
    assert not (stack.trainflow_home / "runs" / "bad").exists()  # nothing written
    assert Allocator(stack.trainflow_home / "state.db").leases() == []  # nothing allocated


def test_run_conf_chip_routes_node_tasks_to_the_chip_queue(client):
    """The shipped task_instance_mutation_hook puts the node tasks on the conf's chip queue;
    a worker without the chip's extension stops the run at once, naming the package."""
    client.unpause(DAG)
    run_id = client.trigger(
        DAG,
        {"chip": "ascend", "nodes": 1, "steps": 20, "checkpoint_interval": 10, "tenant": "routing"},
        run_id="e2e-ascend-1",
    )["dag_run_id"]
    run = client.wait_run(DAG, run_id, timeout=240)
    assert run["state"] == "failed"
    tis = {(t["task_id"], t["map_index"]): t for t in client.task_instances(DAG, run_id)}
    shard = tis[("shard_train", 0)]
    assert shard["queue"] == "ascend-910b" and shard["try_number"] == 1
    log = client.task_log(DAG, run_id, "shard_train", 1, map_index=0)
    assert "'torch_npu' extension" in log and "ascend-910b" in log


def test_three_runs_on_a_pool_that_fits_two_one_waits_deferred(client, stack):
    """Three 2-node runs at once on the embedded pool of 4 nodes: two are admitted, the
    third waits in the pool's queue with its provision deferred (no worker slot held, its
    position and reason in the XCom), and is admitted when one of the others releases its
    nodes; every run succeeds and nothing is left leased or queued."""
    import time

    client.unpause(DAG)
    conf = {"steps": 150, "checkpoint_interval": 50, "tenant": "queue"}
    ids = [client.trigger(DAG, conf, run_id=f"e2e-queue-{i}")["dag_run_id"] for i in range(3)]
    deferred, waiting_xcom = set(), {}
    deadline = time.time() + 900
    while time.time() < deadline:
        states = {}
        for run_id in ids:
            tis = {(t["task_id"], t["map_index"]): t for t in client.task_instances(DAG, run_id)}
            if tis.get(("provision", -1), {}).get("state") == "deferred":
                deferred.add(run_id)
                waiting_xcom.setdefault(run_id, client.xcom(DAG, run_id, "provision", "admission"))
            states[run_id] = client.run(DAG, run_id)["state"]
        if all(s in ("success", "failed") for s in states.values()):
            break
        time.sleep(1)
    assert all(client.run(DAG, r)["state"] == "success" for r in ids), states
    assert len(deferred) == 1, deferred
    (late,) = deferred
    assert waiting_xcom[late]["state"] == "waiting" and waiting_xcom[late]["position"] == 1
    assert "pool 'embedded': needs 2 nodes, 0 of 4 free" in waiting_xcom[late]["reason"]
    assert client.xcom(DAG, late, "provision", "admission")["state"] == "admitted"
    # It trained only after one of the others had given its nodes back.
    released = min(
        t["end_date"] for r in ids if r != late for t in client.task_instances(DAG, r) if t["task_id"] == "release"
    )
    started = min(t["start_date"] for t in client.task_instances(DAG, late) if t["task_id"] == "shard_train")
    assert started >= released
    allocator = Allocator(stack.trainflow_home / "state.db")
    assert allocator.leases() == [] and allocator.queue("embedded") == []


def test_maintenance_dag_applies_retention_on_the_stack(client, stack, finished_run):
    """Last in the module (it deletes the module's history). The housekeeping DAG, run now
    with zero-day bounds: the finished runs' workspaces go, and ``airflow db clean`` (granted
    the metadata database by the ``trainflow_metadata_db`` connection) deletes the runs that
    started before it — but not the maintenance run itself, and the stack stays healthy."""
    from datetime import datetime

    run_id, _ = finished_run
    run_dir = stack.trainflow_home / "runs" / "e2e" / DAG / run_id
    assert (run_dir / "nodes" / "released.json").exists() and client.runs(DAG)
    # The cut stays AIRFLOW_MIN_AGE_S behind now (the live components' job rows must survive
    # it): let the module's first run grow that old, so it is the cut's to take.
    import time

    from trainflow.retention import AIRFLOW_MIN_AGE_S

    first = datetime.fromisoformat(client.run(DAG, run_id)["start_date"].replace("Z", "+00:00")).timestamp()
    time.sleep(max(0.0, first + AIRFLOW_MIN_AGE_S + 5 - time.time()))
    client.wait_for_dag("trainflow_maintenance", timeout=120)
    client.unpause("trainflow_maintenance")
    m = client.trigger("trainflow_maintenance", {"workspace_days": 0, "airflow_days": 0}, run_id="e2e-maintenance-1")[
        "dag_run_id"
    ]
    run = client.wait_run("trainflow_maintenance", m, timeout=300)
    assert run["state"] == "success", client.task_log("trainflow_maintenance", m, "retention", 1)
    out = client.xcom("trainflow_maintenance", m, "retention")
    assert str(run_dir) in out["workspaces"]["runs"] and not run_dir.exists()
    assert out["policy"]["airflow_days"] == 0 and out["state"]["leases"] == 0
    before = datetime.fromisoformat(out["airflow_db_clean"]["before"])
    assert before < datetime.fromisoformat(run["start_date"].replace("Z", "+00:00"))
    # Every run of the module that started before the cut is gone.
    left = client.runs(DAG)
    assert run_id not in [r["dag_run_id"] for r in left]
    assert all(datetime.fromisoformat(r["start_date"].replace("Z", "+00:00")) >= before for r in left), left
    assert client.run("trainflow_maintenance", m)["state"] == "success"  # itself kept
    assert client.health()["metadatabase"]["status"] == "healthy"
