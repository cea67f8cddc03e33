"""Host failure history, cordons and the node preflight (real subprocesses and sockets)."""

from __future__ import annotations

import socket

import pytest

from trainflow import preflight
from trainflow.cluster.hosts import CordonPolicy, HostRegistry
from trainflow.errors import ChipUnavailableError, PreflightError
from trainflow.launch.local import free_port

POLICY = CordonPolicy(failures=3, window_s=60)


@pytest.fixture
def registry(state_target):
    return HostRegistry(state_target)


def test_failures_in_the_window_cordon_the_host(registry):
    assert registry.record_failure("h1", reason="a", run_key="r", node=0, policy=POLICY, now=0) is None
    assert registry.record_failure("h1", reason="b", run_key="r", node=0, policy=POLICY, now=100) is None
    # The first failure left the 60 s window: two recent ones are not enough.
    assert registry.record_failure("h1", reason="c", run_key="r", node=1, policy=POLICY, now=110) is None
    cordon = registry.record_failure("h1", reason="d", run_key="s", node=0, policy=POLICY, now=120)
    assert cordon is not None and cordon.since == 120 and "3 failures in 60s, last: d" in cordon.reason
    assert registry.cordoned("h2") is None
    (h1,) = registry.hosts(policy=POLICY, now=121)
    assert h1["host"] == "h1" and h1["recent_failures"] == 3 and h1["cordoned"]
    assert registry.uncordon("h1") and registry.cordoned("h1") is None
    assert registry.hosts(policy=POLICY, now=121) == []


def test_cordon_policy_from_env():
    assert CordonPolicy.from_env({}) == CordonPolicy(3, 600.0)
    assert CordonPolicy.from_env({"TRAINFLOW_CORDON_FAILURES": "1", "TRAINFLOW_CORDON_WINDOW_S": "30"}) == CordonPolicy(
        1, 30.0
    )
    with pytest.raises(ValueError, match="TRAINFLOW_CORDON_FAILURES"):
        CordonPolicy.from_env({"TRAINFLOW_CORDON_FAILURES": "0"})


def _plan(tmp_path, port):
    return {"spec": {"chip": "cpu"}, "run_dir": str(tmp_path / "run"), "rendezvous": {"endpoint": f"127.0.0.1:{port}"}}


def test_preflight_passes_on_a_healthy_host(tmp_path, registry, monkeypatch):
    monkeypatch.setenv("TRAINFLOW_CHIP_CPU_HEALTH_CMD", "true")
    checks = preflight.run(_plan(tmp_path, free_port()), 0, host="h", registry=registry, policy=POLICY)
    assert [c.name for c in checks] == ["chip_health", "free_disk", "rendezvous"]
    assert all(c.ok for c in checks)


def test_failed_chip_health_cordons_and_a_later_pass_lifts_it(tmp_path, registry, monkeypatch):
    monkeypatch.setenv("TRAINFLOW_CHIP_CPU_HEALTH_CMD", "sh -c 'echo ECC errors >&2; exit 4'")
    with pytest.raises(PreflightError, match=r"node 1 on host h failed preflight: chip_health: .*exited 4: ECC"):
        preflight.run(_plan(tmp_path, free_port()), 1, host="h", registry=registry, policy=POLICY)
    assert "chip health check failed" in registry.cordoned("h").reason
    with pytest.raises(PreflightError, match=r"cordon: host h cordoned since .* health check failed"):
        preflight.run(_plan(tmp_path, free_port()), 1, host="h", registry=registry, policy=POLICY)
    monkeypatch.setenv("TRAINFLOW_CHIP_CPU_HEALTH_CMD", "true")
    checks = preflight.run(_plan(tmp_path, free_port()), 1, host="h", registry=registry, policy=POLICY)
    assert checks[0].name == "cordon" and "cordon lifted" in checks[0].detail
    assert registry.cordoned("h") is None


def test_missing_health_tool_names_the_fix_and_does_not_cordon(tmp_path, registry, monkeypatch):
    monkeypatch.setenv("TRAINFLOW_CHIP_CPU_HEALTH_CMD", "no-such-smi -L")
    with pytest.raises(
        PreflightError,
        match="not found; install .*TRAINFLOW_CHIP_CPU_HEALTH_CMD "
        r"\(not installed on this host\)",
    ):
        preflight.run(_plan(tmp_path, free_port()), 0, host="h", registry=registry, policy=POLICY)
    assert registry.cordoned("h") is None  # a setup error of the host, not a chip fault


def test_worker_without_the_chip_extension_stops_before_any_check(tmp_path, registry):
    """Ascend needs torch_npu, absent here: found without importing it, raised as the
    deterministic ChipUnavailableError (no retry), and the host is not charged."""
    plan = _plan(tmp_path, free_port())
    plan["spec"]["chip"] = "ascend"
    with pytest.raises(ChipUnavailableError, match="'torch_npu' extension.*serve queue 'ascend-910b'"):
        preflight.run(plan, 0, host="h", registry=registry, policy=POLICY)
    assert registry.cordoned("h") is None and registry.hosts(policy=POLICY) == []


def test_preflight_refuses_a_full_checkpoint_disk(tmp_path, registry, monkeypatch):
    monkeypatch.setenv("TRAINFLOW_PREFLIGHT_MIN_FREE_MB", str(2**40))  # more than any disk
    with pytest.raises(PreflightError, match=r"free_disk: .* MiB free on .* needed; free space"):
        preflight.run(_plan(tmp_path, free_port()), 0, host="h", registry=registry, policy=POLICY)


def test_rendezvous_check(tmp_path):
    with socket.socket() as server:  # a store that answers
        server.bind(("127.0.0.1", 0))
        server.listen()
        assert preflight.rendezvous_reachable(f"127.0.0.1:{server.getsockname()[1]}").ok
    refused = preflight.rendezvous_reachable(f"127.0.0.1:{free_port()}")
    assert refused.ok and "not up yet" in refused.detail  # the first agent will host it
    lost = preflight.rendezvous_reachable("rdzv.invalid:29400", timeout=0.5)  # RFC 2606: never resolves
    assert not lost.ok and "unreachable" in lost.detail


def _node_plan(tmp_path):
    return {**_plan(tmp_path, free_port()), "tenant": "t", "dag_id": "d", "run_id": "r"}


def test_node_try_charges_a_silently_dead_predecessor_to_its_host(tmp_path, registry, monkeypatch):
    from trainflow.cluster.nodes import NodeTry

    monkeypatch.setenv("TRAINFLOW_CHIP_CPU_HEALTH_CMD", "true")
    plan = _node_plan(tmp_path)
    policy = CordonPolicy(failures=2, window_s=60)
    NodeTry(plan, 1, 1, host="a", registry=registry, policy=policy).begin()  # then SIGKILLed
    second = NodeTry(plan, 1, 2, host="b", registry=registry, policy=policy)
    second.begin()
    assert [h["host"] for h in registry.hosts(policy=policy)] == ["a"]
    from trainflow.timeline import read

    (lost,) = [e for e in read(plan["run_dir"]) if e["event"] == "node_task_lost"]  # a fault record's cause
    assert (lost["node"], lost["try"], lost["host"]) == (1, 1, "a")
    second.end("exit 1", failure="agent exited with code 1")  # b: one failure, not cordoned
    assert registry.cordoned("b") is None
    third = NodeTry(plan, 1, 3, host="a", registry=registry, policy=policy)
    third.begin()
    third.end("replaced", failure="node 1 replaced")  # a's second failure: cordoned
    assert registry.cordoned("a") is not None


def test_a_try_marker_keeps_its_place_in_the_retry_budget_after_it_ends(tmp_path, registry, monkeypatch):
    """What `trainflow status` and the training page show per node: Airflow's try 7 of a
    cleared run is its try 2 within the run's budget (retries + 1 tries), before and after
    the try ended."""
    import json

    from trainflow.cluster.nodes import NodeTry

    monkeypatch.setenv("TRAINFLOW_CHIP_CPU_HEALTH_CMD", "true")
    plan = _node_plan(tmp_path)
    plan["spec"] = {**plan["spec"], "retries": 2}
    attempt = NodeTry(plan, 1, 7, host="a", registry=registry, run_try=2)
    attempt.begin()
    marker = tmp_path / "run" / "nodes" / "task-0001.json"
    tries = 3
    assert {k: json.loads(marker.read_text())[k] for k in ("host", "try", "run_try", "tries")} == {
        "host": "a", "try": 7, "run_try": 2, "tries": tries}  # fmt: skip
    attempt.end("succeeded")
    ended = json.loads(marker.read_text())
    assert (ended["run_try"], ended["tries"], ended["ended"]) == (2, tries, "succeeded")


def test_a_try_killed_by_an_injected_fault_is_not_charged_to_its_host(tmp_path, registry, monkeypatch):
    """A rehearsal's kill_node/lose_node must not cordon a shared host: the next try sees
    the injected mark and charges nothing, while an uninjected silent death still counts."""
    from trainflow.cluster.nodes import NodeTry, mark_injected, try_lost

    monkeypatch.setenv("TRAINFLOW_CHIP_CPU_HEALTH_CMD", "true")
    plan = _node_plan(tmp_path)
    policy = CordonPolicy(failures=1, window_s=60)  # one charged failure would cordon
    NodeTry(plan, 0, 1, host="a", registry=registry, policy=policy).begin()
    mark_injected(plan["run_dir"], 0, "kill_node")  # then SIGKILLed by the fault
    assert try_lost(plan["run_dir"], 0, 1)  # placement still moves the retry off the host
    NodeTry(plan, 0, 2, host="a", registry=registry, policy=policy).begin()
    assert registry.cordoned("a") is None and registry.hosts(policy=policy) == []
    NodeTry(plan, 0, 3, host="b", registry=registry, policy=policy).begin()  # try 2 died unmarked
    assert registry.cordoned("a") is not None


def test_node_try_takes_only_requests_made_during_it(tmp_path, registry, monkeypatch):
    import time

    from trainflow.cluster.nodes import NodeTry
    from trainflow.workspace import write_json_atomic

    monkeypatch.setenv("TRAINFLOW_CHIP_CPU_HEALTH_CMD", "true")
    attempt = NodeTry(_node_plan(tmp_path), 0, 2, host="h", registry=registry, policy=POLICY)
    attempt.begin()
    assert attempt.replacement_requested() is None
    attempt.request.parent.mkdir(parents=True)
    write_json_atomic(attempt.request, {"time": attempt.started - 10, "reason": "old"})
    assert attempt.replacement_requested() is None  # made for the previous try
    write_json_atomic(attempt.request, {"time": time.time(), "reason": "straggler: rank 0", "cordon": True})
    assert "straggler: rank 0" in attempt.replacement_requested()
    assert registry.cordoned("h").reason == "straggler: rank 0"


def test_preflight_sizes_the_disk_check_from_the_newest_manifest(tmp_path, registry, monkeypatch):
    from trainflow.checkpoint import manifest

    monkeypatch.setenv("TRAINFLOW_CHIP_CPU_HEALTH_CMD", "true")
    monkeypatch.setenv("TRAINFLOW_PREFLIGHT_MIN_FREE_MB", "0")
    root = tmp_path / "run" / "checkpoints"
    partial = manifest.partial_dir(root, 10)
    partial.mkdir(parents=True)
    (partial / "shard.distcp").write_bytes(b"x" * 3 * 2**20)
    ref = manifest.commit(root, 10, world_size=2, training_hash="h")
    assert manifest.committed_bytes(ref.path) == ref.bytes >= 3 * 2**20
    checks = preflight.run(_plan(tmp_path, free_port()), 0, host="h", registry=registry, policy=POLICY)
    disk = next(c for c in checks if c.name == "free_disk")
    assert disk.ok and f"{2 * ref.bytes / 2**20:.0f} MiB needed" in disk.detail


def test_inventory_pools_size_the_pool_and_cordons_shrink_it(state_target):
    """A pool with no set size has as many nodes as registered hosts not cordoned; labels
    and the chip model are recorded; a set size wins."""
    from trainflow.cluster.allocator import Allocator, Lease, Waiting
    from trainflow.errors import SpecError

    hosts, alloc = HostRegistry(state_target), Allocator(state_target)
    for i, rack in enumerate(("r1", "r1", "r2")):
        hosts.register(
            f"gpu-{i}",
            queue="nvidia-h100",
            family="nvidia",
            devices=8,
            pool="h100",
            model="h100",
            labels={"rack": rack},
            now=100,
        )
    hosts.register("cpu-0", queue="cpu", family="cpu", devices=2, now=100)
    assert alloc.pools() == {"cpu": 1, "h100": 3}
    rows = hosts.inventory(pool="h100")
    assert [(r["host"], r["labels"]["rack"], r["model"], r["devices"]) for r in rows] == [
        ("gpu-0", "r1", "h100", 8),
        ("gpu-1", "r1", "h100", 8),
        ("gpu-2", "r2", "h100", 8),
    ]
    hosts.cordon("gpu-1", reason="ECC errors")
    assert alloc.capacity("h100") == 2 and hosts.inventory(pool="h100")[1]["cordoned"] == "ECC errors"
    assert isinstance(alloc.request("r1", tenant="t", pool="h100", nodes=2, ttl=60, now=1), Lease)
    assert isinstance(alloc.request("r2", tenant="t", pool="h100", nodes=1, ttl=60, now=2), Waiting)
    with pytest.raises(SpecError, match="pool 'h100' has only 2 nodes in total"):
        alloc.request("r3", tenant="t", pool="h100", nodes=3, ttl=60, now=3)
    hosts.uncordon("gpu-1")
    assert isinstance(alloc.request("r2", tenant="t", pool="h100", nodes=1, ttl=60, now=4), Lease)
    alloc.set_pool("h100", 16)  # an operator's size wins
    assert alloc.capacity("h100") == 16
    assert hosts.deregister("cpu-0") and not hosts.deregister("cpu-0")
    with pytest.raises(SpecError, match="unknown pool; known pools: h100"):
        alloc.capacity("cpu")
    with pytest.raises(SpecError, match="invalid label"):
        hosts.register("x", queue="cpu", family="cpu", devices=1, labels={"bad key!": "v"})


def test_an_inventory_table_from_an_older_release_gains_the_new_columns(tmp_path):
    import sqlite3

    db = tmp_path / "state.db"
    con = sqlite3.connect(db)
    con.execute(
        "CREATE TABLE inventory (host TEXT PRIMARY KEY, queue TEXT NOT NULL, family TEXT NOT NULL, "
        "devices INTEGER NOT NULL, time REAL NOT NULL)"
    )
    con.execute("INSERT INTO inventory VALUES ('old-host', 'cpu', 'cpu', 2, 1.0)")
    con.commit()
    con.close()
    hosts = HostRegistry(db)
    (row,) = hosts.inventory()
    assert (row["host"], row["pool"], row["labels"], row["model"]) == ("old-host", "cpu", {}, "")
    hosts.register("new-host", queue="cpu", family="cpu", devices=2, labels={"rack": "r1"})
    assert [(r["host"], r["labels"]) for r in HostRegistry(db).inventory()] == [
        ("new-host", {"rack": "r1"}),
        ("old-host", {}),
    ]
