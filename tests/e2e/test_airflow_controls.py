"""Airflow's own controls on a training run, pressed as a user does (REST calls the UI makes):

- "Mark failed" on one node task while the gang trains (which node, and at which step, drawn
  at random: the seed is printed, ``TRAINFLOW_CHAOS_SEED`` replays one) ends the run within
  a bound, every process of the gang stopped, the reason naming the node that was marked
  (the other node would otherwise wait for it in the rendezvous, try after try);
- "Clear" on that failed run (every task) provisions it again: it resumes from the newest
  verified checkpoint, not from step 0, and ends with a clean run's weights.
"""

from __future__ import annotations

import os
import random
import time
from pathlib import Path

import pytest

from trainflow.checkpoint import manifest
from trainflow.testing.confs import FAULT_RUN
from trainflow.testing.procs import processes_naming
from trainflow.timeline import read as read_timeline

pytestmark = pytest.mark.e2e
DAG = "train_digits"
CONF = {**FAULT_RUN, "tenant": "controls"}  # the clean reference is shared
# Mark failed → run ended: node 1 asks Airflow for the gang's states every 5 s, then the
# abort stops its agent, the watch and the downstream tasks; release frees the nodes.
END_BOUND_S = 30.0


def _trigger(client, run_id, conf=CONF):
    client.wait_for_dag(DAG, timeout=120)
    client.unpause(DAG)
    client.trigger(DAG, conf, run_id=run_id)


@pytest.fixture(scope="module")
def clean(reference):
    return reference(CONF)


def _gang_processes(run_dir: str) -> list[int]:
    """Pids of the run's gang (agents and workers name the run's plan or workspace)."""
    return processes_naming(str(run_dir))


def test_mark_failed_ends_the_run_and_clear_resumes_it_to_the_clean_weights(client, clean, wait_training):
    seed = int(os.environ.get("TRAINFLOW_CHAOS_SEED") or time.time())
    rng = random.Random(seed)
    node, at = rng.randrange(2), rng.randrange(80, 200)  # past the first checkpoint, well before the end
    other = 1 - node
    print(f"controls seed {seed}: node {node} marked failed past step {at}")
    run_id = "controls-mark-failed"
    _trigger(client, run_id)
    run_dir = wait_training(client, DAG, run_id, past_step=at)
    assert _gang_processes(run_dir)

    # "Mark failed" on the node, as the UI does it.
    marked = time.time()
    client.call(
        "PATCH",
        f"/api/v2/dags/{DAG}/dagRuns/{run_id}/taskInstances/shard_train/{node}",
        {"new_state": "failed", "note": "marked failed in a test"},
    )
    run = client.wait_run(DAG, run_id, timeout=300, poll=0.5)
    ended_after = time.time() - marked
    tis = {(t["task_id"], t["map_index"]): t for t in client.task_instances(DAG, run_id)}
    assert run["state"] == "failed", tis
    print(f"mark failed → run failed in {ended_after:.1f} s")
    assert ended_after <= END_BOUND_S, (ended_after, tis)
    assert tis[("shard_train", other)]["try_number"] == 1 and tis[("shard_train", other)]["state"] == "failed"
    assert tis[("release", -1)]["state"] == "success"
    (ended,) = [e for e in read_timeline(run_dir) if e["event"] == "member_ended"]
    assert ended["node"] == node and "marked failed by a user" in ended["message"]
    log = client.task_log(DAG, run_id, "shard_train", 1, map_index=other)
    assert f"node {node}'s task is failed" in log
    deadline = time.time() + 30
    while _gang_processes(run_dir) and time.time() < deadline:
        time.sleep(0.5)
    assert _gang_processes(run_dir) == []  # every agent and worker of the gang is gone
    # The newest checkpoint that verifies on disk: an async save can seal after the timeline's
    # last "checkpoint_committed" line when the gang is stopped between the two.
    recorded = max(e["step"] for e in read_timeline(run_dir) if e["event"] == "checkpoint_committed")
    newest = manifest.newest_verified(Path(run_dir) / "checkpoints").step
    assert newest >= recorded

    # "Clear" only the failed tasks: provision does not run again (no admission, the abort
    # record stays), so the node tasks fail at once, saying to clear the whole run.
    client.call(
        "POST",
        f"/api/v2/dags/{DAG}/clearTaskInstances",
        {"dry_run": False, "dag_run_id": run_id, "only_failed": True, "reset_dag_runs": True},
    )
    run = client.wait_run(DAG, run_id, timeout=300)
    assert run["state"] == "failed"
    log = client.task_log(DAG, run_id, "shard_train", 2, map_index=other)
    assert "clear the whole run" in log, log[-2000:]
    assert _gang_processes(run_dir) == []

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


LONG = {**CONF, "steps": 3000, "checkpoint_interval": 250}  # still training when the control is pressed


def _ended_within(client, run_id: str, run_dir: str, pressed: float) -> dict:
    """Wait for the run to end and every process of its gang to be gone; assert both
    happened within ``END_BOUND_S`` of ``pressed``; return the run."""
    run = client.wait_run(DAG, run_id, timeout=300, poll=0.5)
    while _gang_processes(run_dir) and time.time() < pressed + END_BOUND_S:
        time.sleep(0.5)
    ended_after = time.time() - pressed
    print(f"{run_id}: ended {run['state']} in {ended_after:.1f} s")
    assert _gang_processes(run_dir) == [] and ended_after <= END_BOUND_S, ended_after
    return run


def _leased(stack) -> list[str]:
    from trainflow.cluster.allocator import Allocator

    return [lease.run_key for lease in Allocator(stack.trainflow_home / "state.db").leases()]


def test_mark_success_on_a_node_task_ends_the_run_naming_it(client, wait_training):
    """A node marked success while the gang trains never runs again and its ranks are gone:
    the gang cannot finish, so the run ends (failed), saying so, instead of hanging."""
    run_id = "controls-mark-success"
    _trigger(client, run_id, LONG)
    run_dir = wait_training(client, DAG, run_id, past_step=20)
    pressed = time.time()
    client.call(
        "PATCH",
        f"/api/v2/dags/{DAG}/dagRuns/{run_id}/taskInstances/shard_train/0",
        {"new_state": "success", "note": "marked success in a test"},
    )
    run = _ended_within(client, run_id, run_dir, pressed)
    assert run["state"] == "failed"
    (ended,) = [e for e in read_timeline(run_dir) if e["event"] == "member_ended"]
    assert ended["node"] == 0 and "marked success by a user while the gang trained" in ended["message"]
    tis = {(t["task_id"], t["map_index"]): t for t in client.task_instances(DAG, run_id)}
    assert tis[("release", -1)]["state"] == "success"


def test_mark_the_run_failed_stops_every_process_and_frees_its_nodes(client, stack, wait_training):
    """The run's own "Mark failed" (PATCH dagRun state): the same end as ``trainflow cancel``."""
    run_id = "controls-run-failed"
    _trigger(client, run_id, LONG)
    run_dir = wait_training(client, DAG, run_id, past_step=20)
    pressed = time.time()
    client.call("PATCH", f"/api/v2/dags/{DAG}/dagRuns/{run_id}", {"state": "failed"})
    assert _ended_within(client, run_id, run_dir, pressed)["state"] == "failed"
    assert f"controls/{DAG}/{run_id}" not in _leased(stack)


def test_a_running_run_cannot_be_deleted_and_a_deleted_runs_lease_is_freed(client, stack, wait_training):
    """Airflow refuses to delete a running run (the gang trains on); once it ended it can be
    deleted. A lease left by a run that no longer exists (its release never ran) is freed
    by the next run's provision, which asks Airflow about every lease holder."""
    from trainflow.cluster.allocator import Allocator
    from trainflow.rest import RestError

    run_id, next_id = "controls-delete", "controls-after-delete"
    _trigger(client, run_id, LONG)
    run_dir = wait_training(client, DAG, run_id, past_step=20)
    with pytest.raises(RestError, match="cannot be deleted in running state"):
        client.call("DELETE", f"/api/v2/dags/{DAG}/dagRuns/{run_id}")
    assert _gang_processes(run_dir) and client.run(DAG, run_id)["state"] == "running"
    client.call("PATCH", f"/api/v2/dags/{DAG}/dagRuns/{run_id}", {"state": "failed"})
    assert _ended_within(client, run_id, run_dir, time.time())["state"] == "failed"
    client.call("DELETE", f"/api/v2/dags/{DAG}/dagRuns/{run_id}")
    with pytest.raises(RestError, match="404"):
        client.run(DAG, run_id)

    # A lease its release never freed (as if release had failed), held by the deleted run.
    allocator = Allocator(stack.trainflow_home / "state.db")
    allocator.admit(f"controls/{DAG}/{run_id}", tenant="controls", pool="embedded", nodes=2, ttl=3600)
    _trigger(client, next_id, {**CONF, "steps": 20, "checkpoint_interval": 10})
    assert client.wait_run(DAG, next_id, timeout=300)["state"] == "success"
    assert _leased(stack) == []
    log = client.task_log(DAG, next_id, "provision", 1)
    assert f"freed the nodes of controls/{DAG}/{run_id}: the run was deleted" in log, log[-3000:]


def test_two_runs_of_one_conf_train_apart_and_a_pause_holds_their_next_tasks(client, clean):
    """A second run with the same conf trains beside the first (its own workspace, its own
    gang); pausing the DAG mid-run lets the gangs train on, holds the tasks that would come
    next until it is unpaused, and both runs end with the clean run's weights."""
    from trainflow.workspace import completed

    runs = ["controls-same-a", "controls-same-b"]
    for run_id in runs:
        _trigger(client, run_id)
    dirs = {_nodes_running(client, run_id) for run_id in runs}
    assert len(dirs) == 2
    client.call("PATCH", f"/api/v2/dags/{DAG}", {"is_paused": True})
    try:
        deadline = time.time() + 300
        while not all(completed(d) for d in dirs) and time.time() < deadline:
            time.sleep(1)
        assert all(completed(d) for d in dirs)  # the gangs trained on, paused
        time.sleep(15)  # what would come next waits
        for run_id in runs:
            states = {t["task_id"]: t["state"] for t in client.task_instances(DAG, run_id)}
            assert states.get("evaluate") not in ("running", "success"), states
            assert client.run(DAG, run_id)["state"] == "running"
    finally:
        client.unpause(DAG)
    for run_id in runs:
        assert client.wait_run(DAG, run_id, timeout=300)["state"] == "success"
        assert client.xcom(DAG, run_id, "evaluate", "metrics")["weights_sha256"] == clean


def _nodes_running(client, run_id: str, timeout: float = 300) -> str:
    """The run's workspace once both of its node tasks run."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        tis = client.task_instances(DAG, run_id)
        if [t["state"] for t in tis if t["task_id"] == "shard_train"] == ["running", "running"]:
            return client.xcom(DAG, run_id, "provision", "run_dir")
        time.sleep(0.3)
    raise AssertionError(f"{run_id}: its node tasks were not both running within {timeout} s")
