"""Host health: the failure history of each host, cordons, and who may run node tasks.

A host that fails ``CordonPolicy.failures`` times within ``window_s`` seconds (node
tasks killed, agents failed, stalls, failed preflights) is cordoned: no node task of any
run starts there until the host passes its chip health check again (the preflight does
that check and lifts the cordon). A failed chip health check cordons at once. State lives
in trainflow's own database beside the gang leases (``$TRAINFLOW_HOME/state.db``).
"""

from __future__ import annotations

import os
import socket
import time
from contextlib import closing
from dataclasses import dataclass

from trainflow.cluster.allocator import StateDB

_SCHEMA = """
CREATE TABLE IF NOT EXISTS host_failures (
    host TEXT NOT NULL, time REAL NOT NULL, run_key TEXT NOT NULL, node INTEGER NOT NULL,
    reason TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS host_failures_host ON host_failures (host, time);
CREATE TABLE IF NOT EXISTS cordons (host TEXT PRIMARY KEY, since REAL NOT NULL, reason TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS inventory (
    host TEXT PRIMARY KEY, queue TEXT NOT NULL, family TEXT NOT NULL, devices INTEGER NOT NULL,
    time REAL NOT NULL
);
"""


def host_name() -> str:
    """This host's name in the registry: ``TRAINFLOW_HOST`` (set per worker where several
    workers share a machine or a network namespace), else the hostname."""
    return os.environ.get("TRAINFLOW_HOST") or socket.gethostname()


@dataclass(frozen=True)
class CordonPolicy:
    """``failures`` within ``window_s`` seconds cordon a host."""

    failures: int = 3
    window_s: float = 600.0

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> "CordonPolicy":
        """``TRAINFLOW_CORDON_FAILURES`` and ``TRAINFLOW_CORDON_WINDOW_S`` (defaults 3, 600)."""
        env = os.environ if env is None else env
        policy = cls(failures=int(env.get("TRAINFLOW_CORDON_FAILURES", cls.failures)),
                     window_s=float(env.get("TRAINFLOW_CORDON_WINDOW_S", cls.window_s)))
        if policy.failures < 1 or policy.window_s <= 0:
            raise ValueError(f"invalid cordon policy {policy}: TRAINFLOW_CORDON_FAILURES must be ≥ 1 "
                             f"and TRAINFLOW_CORDON_WINDOW_S > 0")
        return policy


@dataclass(frozen=True)
class Cordon:
    host: str
    since: float
    reason: str


class HostRegistry(StateDB):
    """Failure history and cordons in trainflow's database; safe across processes."""

    SCHEMA = _SCHEMA

    def record_failure(self, host: str, *, reason: str, run_key: str, node: int,
                       policy: CordonPolicy, now: float | None = None) -> Cordon | None:
        """Record one failure on ``host``; cordon it when the policy's count is reached.

        Returns:
            The host's cordon if it is cordoned after this failure, else None.
        """
        now = time.time() if now is None else now
        with closing(self._connect()) as con:
            con.execute("BEGIN IMMEDIATE")
            try:
                con.execute("INSERT INTO host_failures VALUES (?, ?, ?, ?, ?)",
                            (host, now, run_key, node, reason[:500]))
                recent = con.execute("SELECT COUNT(*) FROM host_failures WHERE host=? AND time > ?",
                                     (host, now - policy.window_s)).fetchone()[0]
                if recent >= policy.failures:
                    why = f"{recent} failures in {policy.window_s:g}s, last: {reason[:300]}"
                    con.execute("INSERT INTO cordons VALUES (?, ?, ?) ON CONFLICT DO NOTHING", (host, now, why))
                con.execute("COMMIT")
            except BaseException:
                con.execute("ROLLBACK")
                raise
        return self.cordoned(host)

    def cordon(self, host: str, *, reason: str, now: float | None = None) -> Cordon:
        now = time.time() if now is None else now
        with closing(self._connect()) as con:
            con.execute("INSERT INTO cordons VALUES (?, ?, ?) ON CONFLICT DO NOTHING", (host, now, reason[:500]))
        return self.cordoned(host)

    def uncordon(self, host: str) -> bool:
        """Lift the cordon and forget the failure history (the host proved healthy)."""
        with closing(self._connect()) as con:
            con.execute("DELETE FROM host_failures WHERE host=?", (host,))
            return con.execute("DELETE FROM cordons WHERE host=?", (host,)).rowcount > 0

    def cordoned(self, host: str) -> Cordon | None:
        with closing(self._connect()) as con:
            row = con.execute("SELECT host, since, reason FROM cordons WHERE host=?", (host,)).fetchone()
        return Cordon(*row) if row else None

    def register(self, host: str, *, queue: str, family: str, devices: int, now: float | None = None) -> None:
        """Record what ``host`` serves (``trainflow doctor --register``): provision refuses
        a gang whose nproc_per_node no registered host of its queue can give."""
        now = time.time() if now is None else now
        with closing(self._connect()) as con:
            con.execute("INSERT INTO inventory VALUES (?, ?, ?, ?, ?) ON CONFLICT (host) DO UPDATE SET "
                        "queue=excluded.queue, family=excluded.family, devices=excluded.devices, "
                        "time=excluded.time", (host, queue, family, int(devices), now))

    def inventory(self, queue: str | None = None) -> list[dict]:
        """Registered hosts (of ``queue``), most devices first."""
        with closing(self._connect()) as con:
            rows = con.execute("SELECT host, queue, family, devices, time FROM inventory"
                               + (" WHERE queue=?" if queue else "") + " ORDER BY devices DESC, host",
                               (queue,) if queue else ()).fetchall()
        return [dict(zip(("host", "queue", "family", "devices", "time"), r)) for r in rows]

    def hosts(self, *, policy: CordonPolicy, now: float | None = None) -> list[dict]:
        """Every known host with its recent failures and cordon (for the CLI and the UI)."""
        now = time.time() if now is None else now
        with closing(self._connect()) as con:
            failures = dict(con.execute(
                "SELECT host, COUNT(*) FROM host_failures WHERE time > ? GROUP BY host",
                (now - policy.window_s,)).fetchall())
            cordons = {r[0]: Cordon(*r) for r in con.execute("SELECT host, since, reason FROM cordons")}
        return [{"host": h, "recent_failures": failures.get(h, 0),
                 "cordoned": cordons[h].reason if h in cordons else None,
                 "cordoned_since": cordons[h].since if h in cordons else None}
                for h in sorted(set(failures) | set(cordons))]
