"""All-or-nothing gang admission with expiring leases, in trainflow's own database.

The embedded default is SQLite under ``$TRAINFLOW_HOME`` (never Airflow's tables). A run
asks for N nodes of a pool; it gets all of them or none. Leases expire as a backstop, so
a crashed run never holds capacity for ever; ``release`` is idempotent.
"""

from __future__ import annotations

import os
import time
from contextlib import closing, contextmanager
from dataclasses import dataclass
from pathlib import Path

from trainflow.errors import AdmissionError, SpecError

_SCHEMA = """
CREATE TABLE IF NOT EXISTS pools (name TEXT PRIMARY KEY, nodes INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS leases (
    run_key TEXT PRIMARY KEY, tenant TEXT NOT NULL, pool TEXT NOT NULL,
    nodes INTEGER NOT NULL, granted REAL NOT NULL, expires REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS offline (
    pool TEXT NOT NULL, run_key TEXT NOT NULL, until REAL NOT NULL, reason TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS quotas (
    pool TEXT NOT NULL, tenant TEXT NOT NULL, nodes INTEGER NOT NULL, PRIMARY KEY (pool, tenant)
);
CREATE TABLE IF NOT EXISTS waiting (
    run_key TEXT PRIMARY KEY, tenant TEXT NOT NULL, pool TEXT NOT NULL, nodes INTEGER NOT NULL,
    up_to INTEGER NOT NULL, priority INTEGER NOT NULL, submitted REAL NOT NULL, seen REAL NOT NULL
);
"""
# A waiting request its requester stopped renewing for this long is dropped (the requester
# is gone: a deferred provision renews every few seconds; release withdraws it at once).
STALE_WAIT_S = 120.0


def _admissions(capacity: int, offline: int, leases, waiting, now: float, quotas: dict[str, int] | None = None):
    """Which waiting runs start now, by ``trainflow.sched.decide`` over the pool's nodes (a
    node is a 1-chip node of the model; leases and offline nodes occupy the first nodes).

    Without quotas the policy is ``priority``; with quotas (nodes per tenant) it is
    ``fairshare``: requests within their tenant's quota first, least-served tenant first,
    idle quota lent to the others. Admission does not preempt: a start that would need a
    running run reclaimed (``Start.after``) waits instead, and so does every start behind
    it that the free nodes cannot hold without it.

    Returns:
        ``({run_key: nodes}`` of the runs that start, ``{run_key: (position, reason)}`` of
        the others).
    """
    from trainflow.sched import model
    from trainflow.sched.policy import decide

    running, used = [], 0
    unpreemptible = 10**9  # admission does not preempt (yet): what runs outranks every request
    for key, tenant, held, granted in leases:
        if held:
            req = model.Request(id=key, nodes=held, chips_per_node=1, tenant=tenant, priority=unpreemptible,
                                submitted=granted)
            running.append(model.Running(request=req, placement=tuple(range(used, used + held)), started=granted))
        used += held
    if offline:
        req = model.Request(id="\x00offline", nodes=offline, chips_per_node=1, priority=unpreemptible,
                            submitted=now)
        running.append(model.Running(request=req, placement=tuple(range(used, used + offline)), started=now))
    queue = [model.Request(id=key, nodes=n, chips_per_node=1, tenant=tenant, priority=prio, submitted=sub)
             for key, tenant, n, prio, sub in waiting]
    policy = "fairshare" if quotas else "priority"
    decision = decide(policy, pool=model.Pool.uniform(capacity, chips=1), running=running,
                      waiting=queue, now=now, quotas=quotas or None)
    free = capacity - offline - used
    start, held_back, left = {}, [], free
    usage: dict[str, int] = {}
    for _, tenant, held, _ in leases:
        usage[tenant] = usage.get(tenant, 0) + held
    for s in decision.start:
        r = s.request
        borrows = bool(quotas) and usage.get(r.tenant, 0) + r.nodes > quotas.get(r.tenant, 0)
        # Held back: it needs a reclaim (not done) or nodes it would only get by one, or it
        # borrows while a run within its quota waits for nodes (lending stops then).
        if s.after or r.nodes > left or (borrows and held_back):
            held_back.append(r)
            continue
        start[r.id] = r.nodes
        usage[r.tenant] = usage.get(r.tenant, 0) + r.nodes
        left -= r.nodes
    why = {}
    # Positions are 1-based and count every run ahead: those that start now (they are
    # granted when they next ask), then those held back, then the policy's queue.
    for i, r in enumerate(held_back, start=len(start)):
        within = bool(quotas) and usage.get(r.tenant, 0) + r.nodes <= quotas.get(r.tenant, 0)
        why[r.id] = (i + 1, f"needs {r.nodes} node{'s' * (r.nodes != 1)}, {max(left, 0)} of {capacity} free: "
                            + (f"tenant {r.tenant!r} is within its quota of {quotas.get(r.tenant, 0)}; nodes lent "
                               f"to tenants over theirs return when their runs end (admission does not preempt)"
                               if within else "a run within its tenant's quota waits first (no lending meanwhile)"))
    for w in decision.waiting:  # positions count from 0 there
        n = w.request.nodes
        share = (f"; tenant {w.request.tenant!r}: quota {quotas.get(w.request.tenant, 0)} node(s)"
                 if quotas else "")
        ahead = len(start) + len(held_back) + w.position
        why[w.request.id] = (ahead + 1,
                             f"needs {n} node{'s' * (n != 1)}, {max(free, 0)} of {capacity} free"
                             + (f", {ahead} earlier request{'s' * (ahead != 1)} ahead" if ahead else "")
                             + share)
    return start, why


@dataclass(frozen=True)
class Waiting:
    """A request that waits in its pool's queue: its 1-based position and why."""

    run_key: str
    pool: str
    position: int
    reason: str

    def to_dict(self) -> dict:
        return {"state": "waiting", "pool": self.pool, "position": self.position, "reason": self.reason}


@dataclass(frozen=True)
class Lease:
    run_key: str
    tenant: str
    pool: str
    nodes: int
    granted: float
    expires: float


def default_db() -> str:
    """trainflow's database: ``TRAINFLOW_STATE_DB`` or ``$TRAINFLOW_HOME/state.db``."""
    from trainflow.statedb import default_target

    return default_target()


def embedded_capacity() -> int:
    """Node slots of the embedded pool (this machine): ``TRAINFLOW_EMBEDDED_NODES``, default 4."""
    return int(os.environ.get("TRAINFLOW_EMBEDDED_NODES", "4"))


class StateDB:
    """A table set in trainflow's database (``trainflow.statedb``: SQLite in WAL mode or
    PostgreSQL; autocommit, explicit ``BEGIN IMMEDIATE`` where a read-modify-write must be
    atomic); safe across processes and hosts. Subclasses name their ``SCHEMA``."""

    SCHEMA = ""

    def __init__(self, db: Path | str | None = None) -> None:
        from trainflow.statedb import is_postgres, sqlite_path

        target = str(db) if db is not None else default_db()
        self.db = target if is_postgres(target) else sqlite_path(target)
        with closing(self._connect()) as con:
            con.executescript(self.SCHEMA)

    def _connect(self):
        from trainflow.statedb import connect

        return connect(self.db)


class Allocator(StateDB):
    """Gang allocator over trainflow's SQLite database; safe across processes."""

    SCHEMA = _SCHEMA

    def set_pool(self, name: str, nodes: int) -> None:
        with closing(self._connect()) as con:
            con.execute("INSERT INTO pools VALUES (?, ?) ON CONFLICT(name) DO UPDATE SET nodes=excluded.nodes",
                        (name, nodes))

    def set_quota(self, pool: str, tenant: str, nodes: int | None) -> None:
        """Give ``tenant`` a quota of ``nodes`` in ``pool`` (None removes it). A pool with any
        quota admits by fair share (``request``); a tenant without one only borrows idle nodes.

        Raises:
            SpecError: a negative or non-integer quota, or a bad tenant name.
        """
        from trainflow.spec import TrainingSpec

        TrainingSpec(tenant=tenant)  # the tenant field's own check and error
        with closing(self._connect()) as con:
            if nodes is None:
                con.execute("DELETE FROM quotas WHERE pool=? AND tenant=?", (pool, tenant))
                return
            if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 0:
                raise SpecError("quota", nodes, "a whole number of nodes, 0 or more")
            con.execute("INSERT INTO quotas VALUES (?, ?, ?) ON CONFLICT(pool, tenant) DO UPDATE SET "
                        "nodes=excluded.nodes", (pool, tenant, nodes))

    def quotas(self, pool: str) -> dict[str, int]:
        """The pool's quotas, tenant → nodes (empty: admission by priority, no shares)."""
        with closing(self._connect()) as con:
            return dict(con.execute("SELECT tenant, nodes FROM quotas WHERE pool=? ORDER BY tenant",
                                    (pool,)).fetchall())

    def admit(self, run_key: str, *, tenant: str, pool: str, nodes: int, ttl: float,
              up_to: int | None = None, now: float | None = None) -> Lease:
        """Grant ``nodes`` of ``pool`` to ``run_key`` all-or-nothing (idempotent per run);
        with ``up_to``, as many more as are free, up to ``up_to`` in all (an elastic gang).

        Raises:
            SpecError: the pool is unknown or smaller than the request (it would never fit).
            AdmissionError: not enough free nodes right now.
        """
        now = time.time() if now is None else now
        up_to = max(nodes, up_to or nodes)
        with self._transaction() as con:
            capacity = self._fitting_capacity(con, pool, nodes, now)
            mine = con.execute("SELECT nodes FROM leases WHERE run_key=?", (run_key,)).fetchone()
            if mine is None:
                free = capacity - self._offline(con, pool, now) - self._used(con, pool)
                if free < nodes:
                    raise AdmissionError(f"pool {pool!r}: {nodes} nodes asked, {max(free, 0)} of "
                                         f"{capacity} free")
                granted = min(free, up_to)
                con.execute("INSERT INTO leases VALUES (?, ?, ?, ?, ?, ?)",
                            (run_key, tenant, pool, granted, now, now + ttl))
            else:
                granted = mine[0]
                con.execute("UPDATE leases SET expires=? WHERE run_key=?", (now + ttl, run_key))
        return Lease(run_key, tenant, pool, granted, now, now + ttl)

    def request(self, run_key: str, *, tenant: str, pool: str, nodes: int, ttl: float,
                up_to: int | None = None, priority: int = 0, now: float | None = None) -> "Lease | Waiting":
        """Admit the gang in its turn: it is granted (as ``admit``) when the pool's queue
        order lets it start and it fits; otherwise it waits in the pool's queue and the
        answer says where and why. Call again to renew the wait and to be admitted once
        capacity frees (idempotent; a granted run gets its lease back).

        The decision is ``trainflow.sched.decide`` (the code the trace simulator runs) over
        the pool's nodes. Without quotas, the ``priority`` policy: higher priority first,
        first come first served within a priority, and a gang that does not fit blocks the
        ones behind it, so a large gang is never starved by a stream of small ones. With
        quotas (``set_quota``), ``fairshare``: runs within their tenant's quota first, the
        least-served tenant first, idle quota lent to others; while a run within its quota
        waits, nobody borrows. Admission does not preempt (yet): what runs keeps its nodes.

        Raises:
            SpecError: the pool is unknown or smaller than the request (it would never fit).
        """
        now = time.time() if now is None else now
        up_to = max(nodes, up_to or nodes)
        with self._transaction() as con:
            capacity = self._fitting_capacity(con, pool, nodes, now)
            if con.execute("SELECT 1 FROM leases WHERE run_key=?", (run_key,)).fetchone():
                con.execute("UPDATE leases SET expires=? WHERE run_key=?", (now + ttl, run_key))
                granted = con.execute("SELECT nodes FROM leases WHERE run_key=?", (run_key,)).fetchone()[0]
                return Lease(run_key, tenant, pool, granted, now, now + ttl)
            con.execute("DELETE FROM waiting WHERE seen < ?", (now - STALE_WAIT_S,))
            con.execute("INSERT INTO waiting VALUES (?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT(run_key) DO UPDATE SET "
                        "seen=excluded.seen, nodes=excluded.nodes, up_to=excluded.up_to, "
                        "priority=excluded.priority", (run_key, tenant, pool, nodes, up_to, priority, now, now))
            waiting = con.execute("SELECT run_key, tenant, nodes, priority, submitted FROM waiting "
                                  "WHERE pool=?", (pool,)).fetchall()
            leases = con.execute("SELECT run_key, tenant, nodes, granted FROM leases WHERE pool=?",
                                 (pool,)).fetchall()
            offline = self._offline(con, pool, now)
            free = capacity - offline - sum(r[2] for r in leases)
            quotas = dict(con.execute("SELECT tenant, nodes FROM quotas WHERE pool=?", (pool,)).fetchall())
            start, why = _admissions(capacity, offline, leases, waiting, now, quotas)
            if run_key in start:
                ahead = sum(start[k] for k in start if k != run_key)  # granted in this same decision
                granted = nodes + max(0, min(up_to - nodes, free - ahead - nodes))
                con.execute("DELETE FROM waiting WHERE run_key=?", (run_key,))
                con.execute("INSERT INTO leases VALUES (?, ?, ?, ?, ?, ?)",
                            (run_key, tenant, pool, granted, now, now + ttl))
                return Lease(run_key, tenant, pool, granted, now, now + ttl)
            position, reason = why[run_key]
            return Waiting(run_key, pool, position, f"pool {pool!r}: {reason}")

    def queue(self, pool: str) -> list[str]:
        """The pool's waiting runs in admission order (the order ``request`` decides in: by
        priority, or by fair share where the pool has quotas)."""
        now = time.time()
        with closing(self._connect()) as con:
            waiting = con.execute("SELECT run_key, tenant, nodes, priority, submitted FROM waiting "
                                  "WHERE pool=? ORDER BY priority DESC, submitted, run_key", (pool,)).fetchall()
            if not waiting:
                return []
            leases = con.execute("SELECT run_key, tenant, nodes, granted FROM leases WHERE pool=?",
                                 (pool,)).fetchall()
            quotas = dict(con.execute("SELECT tenant, nodes FROM quotas WHERE pool=?", (pool,)).fetchall())
            capacity, offline = self._capacity(con, pool), self._offline(con, pool, now)
        if not quotas:
            return [r[0] for r in waiting]
        start, why = _admissions(capacity, offline, leases, waiting, now, quotas)
        return sorted((r[0] for r in waiting), key=lambda k: (k not in start, why.get(k, (0,))[0]))

    def grow(self, run_key: str, *, by: int = 1, now: float | None = None) -> bool:
        """Add ``by`` nodes to the run's lease if they are free now; False otherwise (or if
        the run holds no lease)."""
        now = time.time() if now is None else now
        with self._transaction() as con:
            row = con.execute("SELECT pool FROM leases WHERE run_key=? AND expires >= ?",
                              (run_key, now)).fetchone()
            if row is None:
                return False
            pool = row[0]
            free = self._capacity(con, pool) - self._offline(con, pool, now) - self._used(con, pool)
            if free < by:
                return False
            con.execute("UPDATE leases SET nodes = nodes + ? WHERE run_key=?", (by, run_key))
            return True

    def lose_node(self, run_key: str, *, until: float, reason: str) -> None:
        """One node of the run's lease is gone (its host failed): the lease shrinks by one
        and the pool counts the node offline until ``until`` or the run's ``release``,
        whichever comes first (past that, the pool's size is its operator's to set)."""
        with self._transaction() as con:
            row = con.execute("SELECT pool FROM leases WHERE run_key=?", (run_key,)).fetchone()
            if row is None:
                return
            con.execute("UPDATE leases SET nodes = CASE WHEN nodes > 0 THEN nodes - 1 ELSE 0 END "
                        "WHERE run_key=?", (run_key,))
            con.execute("INSERT INTO offline VALUES (?, ?, ?, ?)", (row[0], run_key, until, reason))

    def offline(self, pool: str, now: float | None = None) -> int:
        """Nodes of ``pool`` counted offline now."""
        with closing(self._connect()) as con:
            return self._offline(con, pool, time.time() if now is None else now)

    @contextmanager
    def _transaction(self):
        with closing(self._connect()) as con:
            con.execute("BEGIN IMMEDIATE")
            try:
                yield con
                con.execute("COMMIT")
            except BaseException:
                con.execute("ROLLBACK")
                raise

    def _fitting_capacity(self, con, pool: str, nodes: int, now: float) -> int:
        """The pool's size, once a request of ``nodes`` is known to fit it when idle (expired
        leases are dropped on the way)."""
        capacity = self._capacity(con, pool)
        if nodes > capacity:
            raise SpecError("nodes", nodes, f"pool {pool!r} has only {capacity} nodes in total; "
                            f"ask for at most {capacity}")
        con.execute("DELETE FROM leases WHERE expires < ?", (now,))
        return capacity

    @staticmethod
    def _capacity(con, pool: str) -> int:
        row = con.execute("SELECT nodes FROM pools WHERE name=?", (pool,)).fetchone()
        if row is None:
            known = [r[0] for r in con.execute("SELECT name FROM pools ORDER BY name")]
            raise SpecError("pool", pool, f"unknown pool; known pools: {', '.join(known) or 'none'}")
        return row[0]

    @staticmethod
    def _used(con, pool: str) -> int:
        return con.execute("SELECT COALESCE(SUM(nodes), 0) FROM leases WHERE pool=?", (pool,)).fetchone()[0]

    @staticmethod
    def _offline(con, pool: str, now: float) -> int:
        return con.execute("SELECT COUNT(*) FROM offline WHERE pool=? AND until > ?", (pool, now)).fetchone()[0]

    def release(self, run_key: str) -> bool:
        """Free the run's lease (and the nodes it lost, ``lose_node``) or withdraw its waiting
        request; True if it held a lease."""
        with self._transaction() as con:
            con.execute("DELETE FROM offline WHERE run_key=?", (run_key,))
            con.execute("DELETE FROM waiting WHERE run_key=?", (run_key,))
            return con.execute("DELETE FROM leases WHERE run_key=?", (run_key,)).rowcount > 0

    def leases(self, pool: str | None = None, now: float | None = None) -> list[Lease]:
        now = time.time() if now is None else now
        with closing(self._connect()) as con:
            rows = con.execute("SELECT * FROM leases WHERE expires >= ?" + (" AND pool=?" if pool else ""),
                               (now, pool) if pool else (now,)).fetchall()
        return [Lease(*r) for r in rows]
