"""Chaos on the real embedded stack: each injected fault heals with no human action and
the final weights equal a clean run's; a user bug fails the run at once, without retries."""

from __future__ import annotations

import pytest

from trainflow.testing.confs import FAULT_RUN

pytestmark = pytest.mark.e2e
DAG = "train_digits"
CONF = {**FAULT_RUN, "tenant": "chaos"}  # the clean reference is shared


def _run(client, run_id, faults=(), timeout=600):
    client.wait_for_dag(DAG, timeout=120)
    client.unpause(DAG)
    client.trigger(DAG, {**CONF, "faults": list(faults)}, run_id=run_id)
    run = client.wait_run(DAG, run_id, timeout=timeout)
    tis = {(t["task_id"], t["map_index"]): t for t in client.task_instances(DAG, run_id)}
    return run, tis


@pytest.fixture(scope="module")
def clean(reference):
    return reference(CONF)


def test_process_fault_heals_inside_the_node_without_airflow_retry(client, clean):
    run, tis = _run(client, "chaos-kill-rank", [{"kind": "kill_rank", "rank": 1, "step": 120}])
    assert run["state"] == "success"
    assert tis[("shard_train", 0)]["try_number"] == tis[("shard_train", 1)]["try_number"] == 1
    assert client.xcom(DAG, "chaos-kill-rank", "evaluate", "metrics")["weights_sha256"] == clean


def test_hang_is_detected_and_the_node_replaced(client, clean):
    run, tis = _run(client, "chaos-sigstop", [{"kind": "stop_rank", "rank": 1, "step": 120}])
    assert run["state"] == "success", tis
    # The watch asks to replace only the culprit's node (Airflow's retry does it); elastic
    # assigns ranks to nodes in rendezvous order, so rank 1 may live on either node.
    (stall,) = _timeline(client, "chaos-sigstop", "stall_detected")
    assert stall["ranks"] == [1] and "their processes stopped" in stall["message"]
    (culprit,) = stall["nodes"]
    assert tis[("shard_train", culprit)]["try_number"] >= 2
    assert client.xcom(DAG, "chaos-sigstop", "evaluate", "metrics")["weights_sha256"] == clean


def test_corrupt_checkpoint_is_skipped(client, clean):
    run, _ = _run(client, "chaos-corrupt", [{"kind": "corrupt_checkpoint", "rank": 0, "step": 150}])
    assert run["state"] == "success"
    assert client.xcom(DAG, "chaos-corrupt", "evaluate", "metrics")["weights_sha256"] == clean


def test_user_bug_fails_at_once_naming_rank_and_exception(client):
    run, tis = _run(client, "chaos-user-bug", [{"kind": "raise", "rank": 1, "step": 40}], timeout=180)
    assert run["state"] == "failed"
    failed = [t for k, t in tis.items() if k[0] == "shard_train" and t["state"] == "failed"]
    assert failed and all(t["try_number"] == 1 for t in failed)  # no retries burnt
    log = client.task_log(DAG, "chaos-user-bug", "shard_train", 1, map_index=failed[0]["map_index"])
    assert "rank 1 failed in user code, not retried" in log
    assert "injected user bug at step 40" in log
    assert tis[("heartbeat_watch", -1)]["state"] == "failed"


@pytest.mark.parametrize("node", [1, 0], ids=["node-1", "rank-0-node"])
def test_killed_node_task_is_replaced_by_airflow_retry(client, clean, node):
    run_id = f"chaos-kill-node-{node}"
    run, tis = _run(client, run_id, [{"kind": "kill_node", "rank": node, "step": 120}])
    assert run["state"] == "success", tis
    assert max(tis[("shard_train", n)]["try_number"] for n in (0, 1)) >= 2
    assert client.xcom(DAG, run_id, "evaluate", "metrics")["weights_sha256"] == clean


LONG = {**CONF, "steps": 1500, "checkpoint_interval": 250}


@pytest.fixture(scope="module")
def clean_long(reference):
    return reference(LONG)


def test_scheduler_stop_and_restart_mid_run(client, stack, clean_long, wait_training):
    import time

    run_id = "chaos-scheduler-restart"
    client.trigger(DAG, LONG, run_id=run_id)
    wait_training(client, DAG, run_id, past_step=600, timeout=180)
    assert stack.stop_component("scheduler")
    time.sleep(5)
    stack.start()
    run = client.wait_run(DAG, run_id, timeout=900)
    assert run["state"] == "success"
    assert client.xcom(DAG, run_id, "evaluate", "metrics")["weights_sha256"] == clean_long


def _timeline(client, run_id, event):
    from trainflow.timeline import read

    run_dir = client.xcom(DAG, run_id, "provision", "run_dir")
    return [e for e in read(run_dir) if e["event"] == event]


def test_heartbeats_withheld_past_the_timeout_replace_the_node(client, clean_long):
    run_id = "chaos-delay-heartbeats"
    client.trigger(
        DAG, {**LONG, "faults": [{"kind": "delay_heartbeats", "rank": 1, "step": 500, "seconds": 30}]}, run_id=run_id
    )
    run = client.wait_run(DAG, run_id, timeout=900)
    tis = {(t["task_id"], t["map_index"]): t for t in client.task_instances(DAG, run_id)}
    assert run["state"] == "success", tis
    (stall,) = _timeline(client, run_id, "stall_detected")
    assert stall["ranks"] == [1]
    (node,) = stall["nodes"]  # only rank 1's node is asked to go
    assert tis[("shard_train", node)]["try_number"] >= 2
    assert client.xcom(DAG, run_id, "evaluate", "metrics")["weights_sha256"] == clean_long


def test_heartbeats_withheld_within_the_timeout_change_nothing(client, clean):
    run_id = "chaos-delay-heartbeats-short"
    run, tis = _run(client, run_id, [{"kind": "delay_heartbeats", "rank": 1, "step": 60, "seconds": 2}])
    assert run["state"] == "success"
    assert tis[("shard_train", 0)]["try_number"] == tis[("shard_train", 1)]["try_number"] == 1
    assert not _timeline(client, run_id, "stall_detected")
    assert client.xcom(DAG, run_id, "evaluate", "metrics")["weights_sha256"] == clean


def test_straggler_is_reported_and_excluded_after_the_next_checkpoint(client, clean_long):
    run_id = "chaos-straggler"
    # Margin 1.0: the injected straggler is ~4× slower; two ranks sharing two busy cores
    # differ by up to ~70% from noise alone.
    client.trigger(
        DAG,
        {
            **LONG,
            "exclude_stragglers": True,
            "straggler_margin": 1.0,
            "faults": [{"kind": "slow_rank", "rank": 1, "step": 100}],
        },
        run_id=run_id,
    )
    run = client.wait_run(DAG, run_id, timeout=900)
    tis = {(t["task_id"], t["map_index"]): t for t in client.task_instances(DAG, run_id)}
    assert run["state"] == "success", tis
    (excluded,) = _timeline(client, run_id, "straggler_excluded")
    (resumed,) = _timeline(client, run_id, "resumed")
    node = excluded["node"]  # rank 1's node
    # The gang resumes from the newest checkpoint when the replacement joins: the one
    # that triggered the exclusion, or a later one committed while the node restarted.
    assert excluded["rank"] == 1 and resumed["step"] >= excluded["checkpoint_step"] > 100
    assert tis[("shard_train", node)]["try_number"] == 2
    assert _timeline(client, run_id, "host_cordoned")  # lifted by the replacement's preflight
    watch = client.xcom(DAG, run_id, "heartbeat_watch", "return_value")
    assert any(s["rank"] == 1 and s["slower_by"] > 1.0 for s in watch["stragglers"])
    assert client.xcom(DAG, run_id, "evaluate", "metrics")["weights_sha256"] == clean_long


def test_a_higher_priority_run_preempts_a_preemptible_one_which_resumes_bit_identical(
    client, stack, clean_long, wait_training
):
    """Priority preemption applied end to end (4-node pool): a preemptible 2-node run
    trains; a 3-node run of priority 10 arrives and cannot fit; the first is ordered to
    stop, commits a checkpoint, gives its nodes back and waits deferred in the queue; the
    second runs; the first is admitted again, resumes from the very step it stopped at
    (no work lost) and ends with the clean run's weights; nothing stays leased."""
    from datetime import datetime

    from trainflow.cluster.allocator import Allocator

    low, hi = "chaos-preempted", "chaos-preemptor"
    client.trigger(DAG, {**LONG, "preemptible": True}, run_id=low)
    wait_training(client, DAG, low, past_step=400)
    client.trigger(
        DAG,
        {**CONF, "steps": 60, "checkpoint_interval": 30, "nodes": 3, "priority": 10, "tenant": "chaos-hi"},
        run_id=hi,
    )
    assert client.wait_run(DAG, hi, timeout=600)["state"] == "success"
    assert client.wait_run(DAG, low, timeout=900)["state"] == "success"
    assert client.xcom(DAG, low, "evaluate", "metrics")["weights_sha256"] == clean_long

    (stop,) = _timeline(client, low, "preempted")
    assert stop["by"] == f"chaos-hi/{DAG}/{hi}" and 400 < stop["step"] < LONG["steps"]
    assert stop["step"] in [e["step"] for e in _timeline(client, low, "resumed")]
    assert len(_timeline(client, low, "requeued")) == 1 and len(_timeline(client, low, "readmitted")) == 1
    ordered = _timeline(client, low, "preempt_ordered")
    assert {e["node"] for e in ordered} == {0, 1} and "priority 10 > 0" in ordered[0]["reason"]
    for node in (0, 1):
        assert client.xcom(DAG, low, "shard_train", "preempted", map_index=node) == {
            "by": stop["by"],
            "step": stop["step"],
            "forced": False,
        }
    # The preemptor trained only once the preempted gang had stopped and given its nodes back.
    started = min(
        datetime.fromisoformat(t["start_date"]).timestamp()
        for t in client.task_instances(DAG, hi)
        if t["task_id"] == "shard_train"
    )
    assert started >= stop["time"]
    allocator = Allocator(stack.trainflow_home / "state.db")
    assert allocator.leases() == [] and allocator.queue("embedded") == []
    assert allocator.preemption(f"chaos/{DAG}/{low}") is None
