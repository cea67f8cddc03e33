"""Hosts in network namespaces of their own (``trainflow.testing.netns``): each host has an
address of its own, gloo traffic between two hosts crosses between those addresses, a
host cannot reach another's loopback, and the root namespace's services are reachable from
every host on its own 127.0.0.1 through the forwarder. A machine where namespaces cannot
be made fails these tests with the reason (no fallback)."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading

import pytest

from trainflow.launch.local import free_port
from trainflow.testing.netns import HostNetwork, NetnsUnavailable


@pytest.fixture
def echo_port():
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            with conn:
                while data := conn.recv(4096):
                    conn.sendall(data.upper())

    threading.Thread(target=serve, daemon=True).start()
    yield port
    server.close()


@pytest.fixture
def net(echo_port):
    try:
        net = HostNetwork(("a", "b"), ports=(echo_port,)).create()
    except NetnsUnavailable as exc:
        pytest.fail(f"network namespaces cannot be made here: {exc}")
    yield net
    net.destroy()


def on(net: HostNetwork, host: str, code: str, env: dict | None = None, **kw) -> subprocess.Popen:
    import os

    return subprocess.Popen(
        [*net.wrap(host), sys.executable, "-c", code],
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env={**os.environ, **net.env(host), **(env or {})},
        **kw,
    )


def test_each_host_has_its_own_address_and_reaches_services_on_its_loopback(net, echo_port):
    assert net.addr("a") != net.addr("b")
    probe = on(
        net,
        "a",
        f"""
import socket, fcntl, struct
s = socket.create_connection(("127.0.0.1", {echo_port}), timeout=5)
s.sendall(b"ping"); print(s.recv(16).decode())
""",
    )
    out, _ = probe.communicate(timeout=30)
    assert probe.returncode == 0, out
    assert out.strip() == "PING"  # the root namespace's server answered through the forwarder
    assert net.pids("a") == []  # the probe ran inside a's namespace and is gone


def test_gloo_crosses_between_host_addresses_and_loopbacks_are_private(net):
    port = free_port()
    code = f"""
import os, socket, torch, torch.distributed as dist
rank = int(os.environ["RANK"])
dist.init_process_group("gloo", init_method="tcp://{net.addr("a")}:{port}", rank=rank, world_size=2)
t = torch.tensor([rank + 1.0])
dist.all_reduce(t)
peer = None
if rank == 1:
    try:
        socket.create_connection(("127.0.0.1", {port}), timeout=2)
        peer = "reached a's store on b's own loopback"
    except OSError:
        peer = "private"
print(t.item(), peer)
dist.destroy_process_group()
"""
    a = on(net, "a", code, env={"RANK": "0"})
    b = on(net, "b", code, env={"RANK": "1"})
    out_a, _ = a.communicate(timeout=120)
    out_b, _ = b.communicate(timeout=120)
    assert a.returncode == 0 and b.returncode == 0, (out_a, out_b)
    assert out_a.split()[-2] == "3.0" and out_b.split()[-2] == "3.0"
    assert out_b.split()[-1] == "private", out_b


def test_destroy_removes_namespaces_and_links():
    net = HostNetwork(("x",)).create()
    ns, bridge = net.ns("x"), net.bridge
    net.destroy()
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "link"], capture_output=True, text=True).stdout
    assert ns not in listed and bridge not in links
