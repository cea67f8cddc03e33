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

from trainflow.cluster.allocator import HOST_TABLES, StateDB

_SCHEMA = (
    """
CREATE TABLE IF NOT EXISTS host_failures (
    host TEXT NOT NULL, time REAL NOT NULL, run_key TEXT NOT NULL, node INTEGER NOT NULL,
    reason TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS host_failures_host ON host_failures (host, time);
"""
    + HOST_TABLES
)


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
        policy = cls(
            failures=int(env.get("TRAINFLOW_CORDON_FAILURES", cls.failures)),
            window_s=float(env.get("TRAINFLOW_CORDON_WINDOW_S", cls.window_s)),
        )
        if policy.failures < 1 or policy.window_s <= 0:
            raise ValueError(
                f"invalid cordon policy {policy}: TRAINFLOW_CORDON_FAILURES must be ≥ 1 "
                f"and TRAINFLOW_CORDON_WINDOW_S > 0"
            )
        return policy


@dataclass(frozen=True)
class Cordon:
    host: str
    since: float
    reason: str


class HostRegistry(StateDB):
    """Failure history and cordons in trainflow's database; safe across processes."""

    SCHEMA = _SCHEMA

    def record_failure(
        self, host: str, *, reason: str, run_key: str, node: int, policy: CordonPolicy, now: float | None = None
    ) -> Cordon | None:
        """Record one failure on ``host``; cordon it when the policy's count is reached.

        Returns:
            The host's cordon if it is cordoned after this failure, else None.
        """
        now = time.time() if now is None else now
        with closing(self._connect()) as con:
            con.execute("BEGIN IMMEDIATE")
            try:
                con.execute(
                    "INSERT INTO host_failures VALUES (?, ?, ?, ?, ?)", (host, now, run_key, node, reason[:500])
                )
                recent = con.execute(
                    "SELECT COUNT(*) FROM host_failures WHERE host=? AND time > ?", (host, now - policy.window_s)
                ).fetchone()[0]
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

    def register(
        self,
        host: str,
        *,
        queue: str,
        family: str,
        devices: int,
        pool: str | None = None,
        model: str = "",
        labels: dict[str, str] | None = None,
        now: float | None = None,
    ) -> None:
        """Record what ``host`` serves (``trainflow doctor --register``, ``trainflow
        worker``): its chip queue, family and model, ``devices`` chips, the node ``pool`` it
        belongs to (default: its queue) and free-form ``labels`` (``rack=r1``). Provision
        refuses a gang whose nproc_per_node no registered host of its queue can give; a pool
        without a ``set_pool`` size has as many nodes as registered hosts not cordoned.

        Raises:
            SpecError: a label that is not a short ``name=value`` pair.
        """
        import json

        from trainflow.errors import SpecError

        now = time.time() if now is None else now
        labels = dict(labels or {})
        for key, value in labels.items():
            if not (
                isinstance(key, str)
                and isinstance(value, str)
                and 0 < len(key) <= 63
                and len(value) <= 63
                and key.replace("-", "").replace("_", "").replace(".", "").replace("/", "").isalnum()
            ):
                raise SpecError(
                    "label",
                    f"{key}={value}",
                    "name=value, a name of letters, digits, '-', '_', "
                    "'.' or '/' and a value of at most 63 characters, e.g. rack=r1",
                )
        with closing(self._connect()) as con:
            con.execute(
                "INSERT INTO inventory (host, queue, family, devices, time, pool, model, labels) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (host) DO UPDATE SET "
                "queue=excluded.queue, family=excluded.family, devices=excluded.devices, "
                "time=excluded.time, pool=excluded.pool, model=excluded.model, labels=excluded.labels",
                (
                    host,
                    queue,
                    family,
                    int(devices),
                    now,
                    pool or queue,
                    model or "",
                    json.dumps(labels, sort_keys=True),
                ),
            )

    def deregister(self, host: str) -> bool:
        """Take ``host`` out of the inventory (decommissioned); True if it was registered."""
        with closing(self._connect()) as con:
            return con.execute("DELETE FROM inventory WHERE host=?", (host,)).rowcount > 0

    def inventory(self, queue: str | None = None, *, pool: str | None = None) -> list[dict]:
        """Registered hosts (of ``queue``, of ``pool``), most devices first, each with its
        cordon (None: healthy)."""
        import json

        where, args = [], []
        for column, value in (("queue", queue), ("pool", pool)):
            if value:
                where.append(f"i.{column}=?")
                args.append(value)
        with closing(self._connect()) as con:
            rows = con.execute(
                "SELECT i.host, i.queue, i.family, i.devices, i.time, i.pool, i.model, i.labels, "
                "c.reason FROM inventory i LEFT JOIN cordons c ON c.host = i.host"
                + (" WHERE " + " AND ".join(where) if where else "")
                + " ORDER BY i.devices DESC, i.host",
                args,
            ).fetchall()
        keys = ("host", "queue", "family", "devices", "time", "pool", "model", "labels", "cordoned")
        out = [dict(zip(keys, r)) for r in rows]
        for row in out:
            row["labels"] = json.loads(row["labels"] or "{}")
            row["pool"] = row["pool"] or row["queue"]  # registered before pools were recorded
        return out

    def hosts(self, *, policy: CordonPolicy, now: float | None = None) -> list[dict]:
        """Every known host with its recent failures and cordon (for the CLI and the UI)."""
        now = time.time() if now is None else now
        with closing(self._connect()) as con:
            failures = dict(
                con.execute(
                    "SELECT host, COUNT(*) FROM host_failures WHERE time > ? GROUP BY host", (now - policy.window_s,)
                ).fetchall()
            )
            cordons = {r[0]: Cordon(*r) for r in con.execute("SELECT host, since, reason FROM cordons")}
        return [
            {
                "host": h,
                "recent_failures": failures.get(h, 0),
                "cordoned": cordons[h].reason if h in cordons else None,
                "cordoned_since": cordons[h].since if h in cordons else None,
            }
            for h in sorted(set(failures) | set(cordons))
        ]
