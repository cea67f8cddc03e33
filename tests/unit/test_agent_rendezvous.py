"""The agent's rendezvous pace: torch's rendezvous sleeps and state cache follow the poll
interval, a restarted node re-forms the gang on real torch elastic handlers well under
torch's 1 s floor, and a torch without those internals keeps its default pace."""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from trainflow.launch import agent
from trainflow.plan import build_plan, rendezvous_poll_interval
from trainflow.spec import TrainingSpec


@pytest.fixture
def dr(monkeypatch):
    """torch's dynamic_rendezvous module, restored after the test (the tuning patches it)."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    monkeypatch.setattr(dynamic_rendezvous, "_delay", dynamic_rendezvous._delay)
    monkeypatch.setattr(
        dynamic_rendezvous, "_BackendRendezvousStateHolder", dynamic_rendezvous._BackendRendezvousStateHolder
    )
    monkeypatch.setattr(dynamic_rendezvous, "get_method_name", dynamic_rendezvous.get_method_name)
    return dynamic_rendezvous


@pytest.mark.parametrize(
    ("nodes", "poll"),
    [(1, 0.1), (2, 0.1), (10, 0.1), (50, 0.5), (100, 1.0), (4096, 1.0)],
    ids=["1", "2", "10", "50", "100", "4096"],
)
def test_poll_interval_keeps_the_store_under_100_reads_a_second(nodes, poll):
    assert rendezvous_poll_interval(nodes) == pytest.approx(poll)
    assert nodes / poll <= max(100, nodes)


def test_plan_carries_the_poll_interval():
    plan = build_plan(
        TrainingSpec(nodes=2),
        dag_id="d",
        run_id="r",
        run_dir="/tmp/x",
        rdzv_endpoint="127.0.0.1:29400",
        rdzv_backend="c10d",
    )
    assert plan["rendezvous"]["poll_interval"] == rendezvous_poll_interval(2)


def test_rendezvous_sleeps_and_cache_follow_the_poll(dr, monkeypatch):
    slept = []
    monkeypatch.setattr(dr, "_delay", slept.append)
    assert agent.fast_rendezvous_polling(0.1)
    dr._delay(seconds=agent.TORCH_SYNC_DELAY_S)  # the SYNC poll, called as torch calls it
    dr._delay(seconds=(0, 0.3))  # round 0's random skew
    assert slept == [pytest.approx(0.1), pytest.approx((0, 0.03))]
    assert dr._BackendRendezvousStateHolder(backend=None, settings=None)._cache_duration == 0.1


def test_missing_torch_internals_keep_the_default_pace(dr, monkeypatch, caplog):
    monkeypatch.delattr(dr, "_delay")
    holder = dr._BackendRendezvousStateHolder
    with caplog.at_level(logging.WARNING, logger=agent.__name__):
        assert not agent.fast_rendezvous_polling(0.1)
    assert dr._BackendRendezvousStateHolder is holder
    assert "keeping torch's 1 s rendezvous polling" in caplog.text


def test_cheap_records_name_events_as_torch_does(dr):
    def keep_alive():  # a handler method calling its _record
        return record()

    def record():
        return dr.get_method_name()

    def shallow():
        return dr.get_method_name(depth=10_000)

    torch_names = keep_alive(), shallow()
    assert agent.cheap_rendezvous_records()
    assert (keep_alive(), shallow()) == torch_names == ("keep_alive", "no_method_name")


def test_missing_get_method_name_keeps_torch_naming(dr, monkeypatch, caplog):
    monkeypatch.delattr(dr, "get_method_name")
    with caplog.at_level(logging.WARNING, logger=agent.__name__):
        assert not agent.cheap_rendezvous_records()
    assert "keeping torch's rendezvous event naming" in caplog.text


def _handlers(dr, n: int):
    """``n`` handlers on one c10d store, each with its own connection as separate agents have
    (a blocking ``get`` holds a connection)."""
    from datetime import timedelta

    from torch.distributed import TCPStore
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend

    timeout = timedelta(seconds=30)
    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timeout)
    handlers = []
    for _ in range(n):
        store = TCPStore("127.0.0.1", server.port, is_master=False, timeout=timeout)
        handlers.append(
            dr.DynamicRendezvousHandler.from_backend(
                "t", store, C10dRendezvousBackend(store, "t"), n, n, local_addr="127.0.0.1"
            )
        )
    return server, handlers


def test_restarted_node_re_forms_the_gang_within_polls(dr):
    """The agents' restart path on real handlers: node b's worker died, so b joins the next
    round; a sees it waiting (its monitor loop) and joins too. torch's own polling needs at
    least 1 s here (a's SYNC sleep after reopening the round)."""
    assert agent.fast_rendezvous_polling(0.1) and agent.cheap_rendezvous_records()
    _server, (a, b) = _handlers(dr, 2)
    with ThreadPoolExecutor(2) as pool:
        first = sorted(pool.map(lambda h: h.next_rendezvous().rank, (a, b), timeout=30))
        t0 = time.monotonic()
        rejoined = pool.submit(b.next_rendezvous)
        while a.num_nodes_waiting() == 0 and time.monotonic() - t0 < 30:
            time.sleep(0.01)
        noticed = time.monotonic() - t0
        second = [a.next_rendezvous(), rejoined.result(timeout=30)]
        elapsed = time.monotonic() - t0
    for h in (a, b):
        h.shutdown()
    assert first == [0, 1]
    assert sorted(i.rank for i in second) == [0, 1] and {i.world_size for i in second} == {2}
    assert noticed < 0.5 and elapsed < 1.0, (noticed, elapsed)


def test_the_hosts_own_interface_wins_over_the_propagated_one():
    from trainflow.launch.agent import agent_env

    plan = {"env": {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "eth0", "NCCL_DEBUG": "INFO"}}
    env = agent_env(plan, 1, host_env={"GLOO_SOCKET_IFNAME": "tf0"})
    assert "GLOO_SOCKET_IFNAME" not in env  # the host's tf0 stays in effect
    assert env["NCCL_SOCKET_IFNAME"] == "eth0"  # the host sets none: provision's applies
    assert env["NCCL_DEBUG"] == "INFO" and env["TRAINFLOW_NODE"] == "1"
