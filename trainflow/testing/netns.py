"""Hosts with network addresses of their own on one machine: Linux network namespaces.

``HostNetwork`` makes a bridge and, per host, a namespace joined to it by a veth pair (the
host's end is ``tf0`` with an address of the bridge's /24), so traffic between two hosts
(rendezvous, gloo) really crosses between addresses. The services the hosts use (PostgreSQL,
Redis, the Airflow API, S3) listen on the machine's loopback; ``HostNetwork`` gives each
namespace the same ``127.0.0.1:<port>`` by a forwarder whose listening sockets are opened
*inside* the namespace (``setns``) and whose outgoing connections leave from the root
namespace, like a sidecar proxy: one configuration serves every host.

Needs CAP_NET_ADMIN (root here). ``create`` raises ``NetnsUnavailable`` with the reason
when the kernel or the privileges refuse; it never falls back to shared addresses.
"""

from __future__ import annotations

import ctypes
import ipaddress
import os
import random
import selectors
import socket
import subprocess
import threading
from dataclasses import dataclass, field

CLONE_NEWNET = 0x40000000
IFNAME = "tf0"  # the host's interface in its namespace (GLOO_SOCKET_IFNAME)


class NetnsUnavailable(RuntimeError):
    """Network namespaces cannot be made here (the reason is the message)."""


def _ip(*args: str, ns: str | None = None) -> None:
    argv = (["ip", "netns", "exec", ns, "ip"] if ns else ["ip"]) + list(args)
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    except FileNotFoundError as exc:
        raise NetnsUnavailable("the `ip` command (iproute2) is not installed") from exc
    if out.returncode != 0:
        raise NetnsUnavailable(f"`{' '.join(argv)}` failed: {out.stderr.strip() or out.stdout.strip()}")


def _setns(fd: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise NetnsUnavailable(f"setns: {os.strerror(err)}")


@dataclass
class HostNetwork:
    """A bridge and one network namespace per host name.

    Attributes:
        hosts: host names (letters, digits, ``-``).
        ports: loopback ports of the root namespace every host reaches as its own
            ``127.0.0.1:<port>``.
    """

    hosts: tuple[str, ...]
    ports: tuple[int, ...] = ()
    tag: str = field(default_factory=lambda: f"{random.randrange(16**4):04x}")
    subnet: ipaddress.IPv4Network | None = None

    def __post_init__(self) -> None:
        if self.subnet is None:
            self.subnet = ipaddress.ip_network(f"10.{random.randrange(64, 250)}.{random.randrange(256)}.0/24")
        self._forwarder: _Forwarder | None = None
        self._made: list[tuple[str, str]] = []

    @property
    def bridge(self) -> str:
        return f"tfbr{self.tag}"

    def ns(self, host: str) -> str:
        return f"tf{self.tag}-{host}"

    def addr(self, host: str) -> str:
        """The host's address (its ``tf0``)."""
        return str(self.subnet.network_address + 2 + self.hosts.index(host))

    def wrap(self, host: str) -> list[str]:
        """The argv prefix that runs a command on ``host``."""
        return ["ip", "netns", "exec", self.ns(host)]

    def env(self, host: str) -> dict[str, str]:
        """What a process on ``host`` needs: gloo on ``tf0``, torch elastic's address."""
        return {"GLOO_SOCKET_IFNAME": IFNAME, "TRAINFLOW_HOST_ADDR": self.addr(host)}

    def create(self) -> "HostNetwork":
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            self._made.append(("link", self.bridge))
            _ip("addr", "add", f"{self.subnet.network_address + 1}/{self.subnet.prefixlen}", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for i, host in enumerate(self.hosts):
                ns, veth = self.ns(host), f"tfv{self.tag}{i}"
                _ip("netns", "add", ns)
                self._made.append(("netns", ns))
                _ip("link", "add", veth, "type", "veth", "peer", "name", IFNAME, "netns", ns)
                self._made.append(("link", veth))
                _ip("link", "set", veth, "master", self.bridge, "up")
                _ip("addr", "add", f"{self.addr(host)}/{self.subnet.prefixlen}", "dev", IFNAME, ns=ns)
                _ip("link", "set", IFNAME, "up", ns=ns)
                _ip("link", "set", "lo", "up", ns=ns)
            self._forwarder = _Forwarder([(self.ns(h), p) for h in self.hosts for p in self.ports])
        except BaseException:
            self.destroy()
            raise
        return self

    def pids(self, host: str) -> list[int]:
        """Processes running in ``host``'s namespace."""
        out = subprocess.run(["ip", "netns", "pids", self.ns(host)], capture_output=True, text=True)
        return [int(p) for p in out.stdout.split()]

    def destroy(self) -> None:
        """Remove the forwarder, namespaces and links (killing what still runs in them)."""
        import signal

        if self._forwarder is not None:
            self._forwarder.close()
            self._forwarder = None
        for kind, name in reversed(self._made):
            if kind == "netns":
                for pid in subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True).stdout.split():
                    try:
                        os.kill(int(pid), signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                subprocess.run(["ip", "netns", "del", name], capture_output=True)
            else:
                subprocess.run(["ip", "link", "del", name], capture_output=True)
        self._made.clear()


def _pipe(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(1 << 16):
            dst.sendall(data)
    except OSError:
        pass
    for s in (src, dst):
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
    src.close()


class _Forwarder:
    """Listening sockets inside namespaces, each connection piped to the same port on the
    root namespace's loopback (an accepting thread; two threads a connection)."""

    def __init__(self, listeners: list[tuple[str, int]]) -> None:
        self.sel = selectors.DefaultSelector()
        self._stop = threading.Event()
        home = os.open("/proc/self/ns/net", os.O_RDONLY)
        try:
            for ns, port in listeners:
                fd = os.open(f"/run/netns/{ns}", os.O_RDONLY)
                try:
                    _setns(fd)
                    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                    sock.bind(("127.0.0.1", port))
                    sock.listen(64)
                    sock.setblocking(False)
                    self.sel.register(sock, selectors.EVENT_READ, ("accept", port))
                finally:
                    _setns(home)
                    os.close(fd)
        finally:
            os.close(home)
        self._thread = threading.Thread(target=self._serve, name="netns-forwarder", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            for key, _ in self.sel.select(timeout=0.2):
                self._accept(key.fileobj, key.data[1])

    def _accept(self, listener: socket.socket, port: int) -> None:
        try:
            inner, _ = listener.accept()
        except BlockingIOError:
            return
        try:
            outer = socket.create_connection(("127.0.0.1", port), timeout=10)
        except OSError:
            inner.close()
            return
        for s in (inner, outer):
            s.settimeout(None)
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        # One thread a direction: a blocked send never stalls another connection.
        for src, dst in ((inner, outer), (outer, inner)):
            threading.Thread(target=_pipe, args=(src, dst), daemon=True).start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        for key in list(self.sel.get_map().values()):
            key.fileobj.close()
        self.sel.close()
