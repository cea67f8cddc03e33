"""Airflow's own controls on a training run, pressed as a user does (REST calls the UI makes):

- "Mark failed" on one node task while the gang trains ends the run within a bound, every
  process of the gang stopped, the reason naming the node that was marked (the other node
  would otherwise wait for it in the rendezvous, try after try);
- "Clear" on that failed run (every task) provisions it again: it resumes from the newest
  verified checkpoint, not from step 0, and ends with a clean run's weights.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from trainflow.checkpoint import manifest
from trainflow.timeline import read as read_timeline

pytestmark = pytest.mark.e2e
DAG = "train_digits"
CONF = {
    "steps": 300,
    "checkpoint_interval": 50,
    "heartbeat_interval": 0.5,
    "heartbeat_timeout": 8.0,
    "startup_timeout": 120.0,
    "tenant": "controls",
    "seed": 11,
}
# Mark failed → run ended: node 1 asks Airflow for the gang's states every 5 s, then the
# abort stops its agent, the watch and the downstream tasks; release frees the nodes.
END_BOUND_S = 30.0


def _trigger(client, run_id):
    client.wait_for_dag(DAG, timeout=120)
    client.unpause(DAG)
    client.trigger(DAG, CONF, run_id=run_id)


@pytest.fixture(scope="module")
def clean(reference):
    return reference(CONF)


def _gang_processes(run_dir: str) -> list:
    """Processes of the run's gang (agents and workers name the run's plan or workspace)."""
    import psutil

    found = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if any(run_dir in part for part in (p.info["cmdline"] or [])):
                found.append(p)
        except psutil.Error:
            continue
    return found


def test_mark_failed_ends_the_run_and_clear_resumes_it_to_the_clean_weights(client, clean, wait_training):
    run_id = "controls-mark-failed"
    _trigger(client, run_id)
    run_dir = wait_training(client, DAG, run_id, past_step=120)  # past its first checkpoints
    assert _gang_processes(run_dir)

    # "Mark failed" on node 0, as the UI does it.
    marked = time.time()
    client.call(
        "PATCH",
        f"/api/v2/dags/{DAG}/dagRuns/{run_id}/taskInstances/shard_train/0",
        {"new_state": "failed", "note": "marked failed in a test"},
    )
    run = client.wait_run(DAG, run_id, timeout=300, poll=0.5)
    ended_after = time.time() - marked
    tis = {(t["task_id"], t["map_index"]): t for t in client.task_instances(DAG, run_id)}
    assert run["state"] == "failed", tis
    print(f"mark failed → run failed in {ended_after:.1f} s")
    assert ended_after <= END_BOUND_S, (ended_after, tis)
    assert tis[("shard_train", 1)]["try_number"] == 1 and tis[("shard_train", 1)]["state"] == "failed"
    assert tis[("release", -1)]["state"] == "success"
    (ended,) = [e for e in read_timeline(run_dir) if e["event"] == "member_ended"]
    assert ended["node"] == 0 and "marked failed by a user" in ended["message"]
    log = client.task_log(DAG, run_id, "shard_train", 1, map_index=1)
    assert "node 0's task is failed" in log
    deadline = time.time() + 30
    while _gang_processes(run_dir) and time.time() < deadline:
        time.sleep(0.5)
    assert _gang_processes(run_dir) == []  # every agent and worker of the gang is gone
    # The newest checkpoint that verifies on disk: an async save can seal after the timeline's
    # last "checkpoint_committed" line when the gang is stopped between the two.
    recorded = max(e["step"] for e in read_timeline(run_dir) if e["event"] == "checkpoint_committed")
    newest = manifest.newest_verified(Path(run_dir) / "checkpoints").step
    assert newest >= recorded

    # "Clear" the whole failed run, as the UI does it: it is provisioned again and resumes.
    client.call(
        "POST",
        f"/api/v2/dags/{DAG}/clearTaskInstances",
        {"dry_run": False, "dag_run_id": run_id, "only_failed": False, "reset_dag_runs": True},
    )
    run = client.wait_run(DAG, run_id, timeout=600)
    tis = {(t["task_id"], t["map_index"]): t for t in client.task_instances(DAG, run_id)}
    assert run["state"] == "success", tis
    resume = client.xcom(DAG, run_id, "provision", "resume_from")
    assert resume is not None and resume["step"] == newest > 0, resume  # not from scratch
    events = read_timeline(run_dir)
    assert [e["epoch"] for e in events if e["event"] == "provisioned_again"] == [2]
    assert client.xcom(DAG, run_id, "evaluate", "metrics")["weights_sha256"] == clean
