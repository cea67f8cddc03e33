"""All-or-nothing gang admission with expiring leases, in trainflow's own database.

The embedded default is SQLite under ``$TRAINFLOW_HOME`` (never Airflow's tables). A run
asks for N nodes of a pool; it gets all of them or none. Leases expire as a backstop, so
a crashed run never holds capacity for ever; ``release`` is idempotent.
"""

from __future__ import annotations

import logging
import os
import time
from contextlib import closing, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from trainflow.errors import AdmissionError, SpecError

log = logging.getLogger(__name__)
# Airflow run states after which a run holds nothing (``release_gone``).
ENDED_RUN_STATES = frozenset({"success", "failed"})

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
CREATE TABLE IF NOT EXISTS preemptible (
    run_key TEXT PRIMARY KEY, priority INTEGER NOT NULL, submitted REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS pool_policies (pool TEXT PRIMARY KEY, policy TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS estimates (run_key TEXT PRIMARY KEY, seconds REAL NOT NULL);
CREATE TABLE IF NOT EXISTS run_history (
    scope TEXT NOT NULL, steps INTEGER NOT NULL, seconds REAL NOT NULL, ended REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS run_history_scope ON run_history (scope, ended);
CREATE TABLE IF NOT EXISTS host_leases (
    host TEXT PRIMARY KEY, run_key TEXT NOT NULL, dag_run TEXT NOT NULL, slot INTEGER NOT NULL,
    pool TEXT NOT NULL, chips INTEGER NOT NULL, since REAL NOT NULL,
    routed_try INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS host_leases_run ON host_leases (dag_run, slot);
CREATE TABLE IF NOT EXISTS preemptions (
    run_key TEXT PRIMARY KEY, pool TEXT NOT NULL, by_key TEXT NOT NULL, at REAL NOT NULL,
    reason TEXT NOT NULL
);
"""
# host_leases: which registered host holds which node slot of which run (in pools made of
# registered hosts; a pool sized by ``set_pool`` counts nodes). ``slot`` -1: the run lost
# that host's node (the host stays out of placement until the run releases). ``routed_try``:
# the node task's try the slot was last routed for (a later try may move to another host).
# No SQL comments in these scripts: PostgreSQL runs them statement by statement.
# The hosts' tables (``trainflow.cluster.hosts``), which the allocator reads too: a pool with
# no size of its own (``set_pool``) has as many nodes as it has registered hosts that are not
# cordoned.
HOST_TABLES = """
CREATE TABLE IF NOT EXISTS cordons (host TEXT PRIMARY KEY, since REAL NOT NULL, reason TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS inventory (
    host TEXT PRIMARY KEY, queue TEXT NOT NULL, family TEXT NOT NULL, devices INTEGER NOT NULL,
    time REAL NOT NULL, pool TEXT NOT NULL DEFAULT '', model TEXT NOT NULL DEFAULT '',
    labels TEXT NOT NULL DEFAULT '{}'
);
"""
# Columns added to a table after its first release: (table, column, declaration).
ADDED_COLUMNS = (
    ("inventory", "pool", "TEXT NOT NULL DEFAULT ''"),
    ("inventory", "model", "TEXT NOT NULL DEFAULT ''"),
    ("inventory", "labels", "TEXT NOT NULL DEFAULT '{}'"),
)
# A waiting request its requester stopped renewing for this long is dropped (the requester
# is gone: a deferred provision renews every few seconds; release withdraws it at once).
STALE_WAIT_S = 120.0
# Policies a pool without quotas can be set to (a pool with quotas admits by fair share).
POOL_POLICIES = ("priority", "fifo", "backfill")
# Completed runs kept per history scope, and how many of the newest an estimate uses.
HISTORY_KEEP, HISTORY_USE = 20, 5


def _rack(labels: str | None) -> str | None:
    """A host's ``rack`` label, from its inventory row's labels (JSON)."""
    import json

    return json.loads(labels or "{}").get("rack")


def _admissions(
    capacity: int,
    offline: int,
    leases,
    waiting,
    now: float,
    quotas: dict[str, int] | None = None,
    preemptible: dict[str, tuple[int, float]] | None = None,
    policy: str = "priority",
    estimates: dict[str, float] | None = None,
):
    """Which waiting runs start now, by ``trainflow.sched.decide`` over the pool's nodes (a
    node is a 1-chip node of the model; leases and offline nodes occupy the first nodes).

    Without quotas the policy is the pool's (``priority`` unless set to ``fifo`` or
    ``backfill``: EASY backfill over ``estimates``, run key → expected seconds from
    admission to release; a running run past its estimate is expected to end in a second);
    with quotas (nodes per tenant) it is ``fairshare``: requests within their tenant's quota
    first, least-served tenant first, idle quota lent to the others. Only runs in ``preemptible`` (run key → its priority and
    first submission) can be preempted, by a higher priority or by a quota reclaim; every
    other run keeps its nodes until it ends. A start that needs runs preempted
    (``Start.after``) waits until they have checkpointed and given their nodes back, and so
    does every start behind it that the free nodes cannot hold without them.

    Returns:
        ``({run_key: nodes}`` of the runs that start, ``{run_key: (position, reason)}`` of
        the others, ``{victim run_key: (preemptor run_key, reason)}`` of the runs to preempt).
    """
    from trainflow.sched import model
    from trainflow.sched.policy import decide

    running, used = [], 0
    preemptible, estimates = preemptible or {}, estimates or {}
    unpreemptible = 10**9  # a run that cannot be preempted outranks every request
    for key, tenant, held, granted in leases:
        if held:
            prio, submitted = preemptible.get(key, (unpreemptible, granted))
            est = estimates.get(key)
            req = model.Request(
                id=key,
                nodes=held,
                chips_per_node=1,
                tenant=tenant,
                priority=prio,
                submitted=submitted,
                preemptible=key in preemptible,
                estimate=None if est is None else max(est, now - granted + 1.0),
            )
            running.append(model.Running(request=req, placement=tuple(range(used, used + held)), started=granted))
        used += held
    if offline:
        req = model.Request(
            id="\x00offline", nodes=offline, chips_per_node=1, priority=unpreemptible, submitted=now, preemptible=False
        )
        running.append(model.Running(request=req, placement=tuple(range(used, used + offline)), started=now))
    queue = [
        model.Request(
            id=key, nodes=n, chips_per_node=1, tenant=tenant, priority=prio, submitted=sub, estimate=estimates.get(key)
        )
        for key, tenant, n, prio, sub in waiting
    ]
    policy = "fairshare" if quotas else policy
    decision = decide(
        policy,
        pool=model.Pool.uniform(capacity, chips=1),
        running=running,
        waiting=queue,
        now=now,
        quotas=quotas or None,
    )
    free = capacity - offline - used
    victims = {p.running.request.id: p.reason for p in decision.preempt}
    preempt: dict[str, tuple[str, str]] = {}
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
            for v in s.after:
                preempt.setdefault(v, (r.id, victims[v]))
            continue
        start[r.id] = r.nodes
        usage[r.tenant] = usage.get(r.tenant, 0) + r.nodes
        left -= r.nodes
    why = {}
    after = {s.request.id: s.after for s in decision.start}
    # Positions are 1-based and count every run ahead: those that start now (they are
    # granted when they next ask), then those held back, then the policy's queue.
    for i, r in enumerate(held_back, start=len(start)):
        within = bool(quotas) and usage.get(r.tenant, 0) + r.nodes <= quotas.get(r.tenant, 0)
        need = f"needs {r.nodes} node{'s' * (r.nodes != 1)}, {max(left, 0)} of {capacity} free: "
        if after.get(r.id):
            names = ", ".join(repr(v) for v in after[r.id])
            why[r.id] = (
                i + 1,
                need + f"preempting {names} ({victims[after[r.id][0]]}); it starts once "
                f"they have checkpointed and given their nodes back",
            )
        elif within:
            why[r.id] = (
                i + 1,
                need + f"tenant {r.tenant!r} is within its quota of {quotas.get(r.tenant, 0)}; "
                f"nodes lent to tenants over theirs return when their runs end",
            )
        else:
            why[r.id] = (i + 1, need + "a run within its tenant's quota waits first (no lending meanwhile)")
    for w in decision.waiting:  # positions count from 0 there
        n, t = w.request.nodes, w.request.tenant
        share = ""
        if quotas and usage.get(t, 0) + n <= quotas.get(t, 0):
            share = (
                f"; tenant {t!r} is within its quota of {quotas.get(t, 0)}: nodes lent to tenants over "
                f"theirs return when their runs end (runs that are not preemptible keep their nodes)"
            )
        elif quotas:
            share = f"; tenant {t!r}: quota {quotas.get(t, 0)} node(s)"
        ahead = len(start) + len(held_back) + w.position
        why[w.request.id] = (
            ahead + 1,
            f"needs {n} node{'s' * (n != 1)}, {max(free, 0)} of {capacity} free"
            + (f", {ahead} earlier request{'s' * (ahead != 1)} ahead" if ahead else "")
            + share,
        )
    return start, why, preempt


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
    # The registered hosts of the run's node slots, slot order (a pool of registered hosts;
    # empty for a pool sized by ``set_pool``, whose nodes Celery's queue picks).
    hosts: tuple[str, ...] = ()


def default_db() -> str:
    """trainflow's database: ``TRAINFLOW_STATE_DB`` or ``$TRAINFLOW_HOME/state.db``."""
    from trainflow.statedb import default_target

    return default_target()


def embedded_capacity() -> int:
    """Node slots of the embedded pool (this machine): ``TRAINFLOW_EMBEDDED_NODES``, default 4."""
    return int(os.environ.get("TRAINFLOW_EMBEDDED_NODES", "4"))


def _add_column(con, table: str, column: str, decl: str) -> None:
    """Give a table created by an older release a column it lacks (idempotent, and safe
    when several processes open the database at once)."""
    try:
        con.execute(f"SELECT {column} FROM {table} LIMIT 0")
        return
    except Exception:  # noqa: BLE001 - sqlite3 / psycopg2: no such column
        pass
    try:
        con.execute(f"ALTER TABLE {table} ADD COLUMN {column} {decl}")
    except Exception:  # noqa: BLE001 - another process added it first
        con.execute(f"SELECT {column} FROM {table} LIMIT 0")


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
            for table, column, decl in ADDED_COLUMNS:
                if f"TABLE IF NOT EXISTS {table} (" in self.SCHEMA:
                    _add_column(con, table, column, decl)

    def _connect(self):
        from trainflow.statedb import connect

        return connect(self.db)


class Allocator(StateDB):
    """Gang allocator over trainflow's SQLite database; safe across processes."""

    SCHEMA = _SCHEMA + HOST_TABLES

    def set_pool(self, name: str, nodes: int, *, policy: str | None = None) -> None:
        """Create or resize pool ``name``; with ``policy`` (``priority``, ``fifo`` or
        ``backfill``), also set how it admits while it has no quotas (default: priority).

        Raises:
            SpecError: an unknown policy.
        """
        if policy is not None and policy not in POOL_POLICIES:
            raise SpecError(
                "policy",
                policy,
                f"choose one of {', '.join(POOL_POLICIES)} (a pool with tenant quotas admits by fair share)",
            )
        with closing(self._connect()) as con:
            con.execute(
                "INSERT INTO pools VALUES (?, ?) ON CONFLICT(name) DO UPDATE SET nodes=excluded.nodes", (name, nodes)
            )
            if policy is not None:
                con.execute(
                    "INSERT INTO pool_policies VALUES (?, ?) ON CONFLICT(pool) DO UPDATE SET policy=excluded.policy",
                    (name, policy),
                )

    def pools(self) -> dict[str, int]:
        """Every pool (sized by ``set_pool`` or by its registered hosts) and its size in nodes."""
        with closing(self._connect()) as con:
            names = {r[0] for r in con.execute("SELECT name FROM pools")} | {
                r[0] for r in con.execute("SELECT DISTINCT pool FROM inventory WHERE pool != ''")
            }
            return {name: self._capacity(con, name) for name in sorted(names)}

    def capacity(self, pool: str) -> int:
        """The pool's size in nodes.

        Raises:
            SpecError: an unknown pool (naming the known ones).
        """
        with closing(self._connect()) as con:
            return self._capacity(con, pool)

    def policy(self, pool: str) -> str:
        """How ``pool`` admits now: ``fairshare`` if it has quotas, else its set policy."""
        with closing(self._connect()) as con:
            return self._policy(con, pool)

    @staticmethod
    def _policy(con, pool: str) -> str:
        if con.execute("SELECT 1 FROM quotas WHERE pool=? LIMIT 1", (pool,)).fetchone():
            return "fairshare"
        row = con.execute("SELECT policy FROM pool_policies WHERE pool=?", (pool,)).fetchone()
        return row[0] if row else "priority"

    def estimate(self, scope: str, steps: int) -> float | None:
        """Expected seconds from admission to release of a run of ``steps`` steps, from the
        newest completed runs of the same ``scope`` (their median seconds per step); None
        without history."""
        with closing(self._connect()) as con:
            rows = con.execute(
                "SELECT seconds, steps FROM run_history WHERE scope=? ORDER BY ended DESC LIMIT ?", (scope, HISTORY_USE)
            ).fetchall()
        if not rows:
            return None
        import statistics

        return statistics.median(sec / max(n, 1) for sec, n in rows) * steps

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
            con.execute(
                "INSERT INTO quotas VALUES (?, ?, ?) ON CONFLICT(pool, tenant) DO UPDATE SET nodes=excluded.nodes",
                (pool, tenant, nodes),
            )

    def quotas(self, pool: str) -> dict[str, int]:
        """The pool's quotas, tenant → nodes (empty: admission by priority, no shares)."""
        with closing(self._connect()) as con:
            return dict(
                con.execute("SELECT tenant, nodes FROM quotas WHERE pool=? ORDER BY tenant", (pool,)).fetchall()
            )

    def admit(
        self,
        run_key: str,
        *,
        tenant: str,
        pool: str,
        nodes: int,
        ttl: float,
        up_to: int | None = None,
        chips: int = 1,
        now: float | None = None,
    ) -> Lease:
        """Grant ``nodes`` of ``pool`` to ``run_key`` all-or-nothing (idempotent per run);
        with ``up_to``, as many more as are free, up to ``up_to`` in all (an elastic gang).
        In a pool of registered hosts, the nodes are hosts with ``chips`` chips or more,
        placed by ``trainflow.sched.capacity.place`` (``Lease.hosts``).

        Raises:
            SpecError: the pool is unknown or smaller than the request (it would never fit).
            AdmissionError: not enough free nodes right now.
        """
        now = time.time() if now is None else now
        up_to = max(nodes, up_to or nodes)
        with self._transaction() as con:
            capacity = self._fitting_capacity(con, pool, nodes, now, chips)
            mine = con.execute("SELECT nodes FROM leases WHERE run_key=?", (run_key,)).fetchone()
            if mine is None:
                free = capacity - self._offline(con, pool, now) - self._used(con, pool)
                if free < nodes:
                    raise AdmissionError(f"pool {pool!r}: {nodes} nodes asked, {max(free, 0)} of {capacity} free")
                granted = min(free, up_to)
                hosts = None
                if self._host_pool(con, pool):
                    granted, hosts = self._place_gang(con, pool, nodes, granted, chips)
                    if hosts is None:
                        raise AdmissionError(f"pool {pool!r}: {self._no_room(con, pool, nodes, chips)}")
                con.execute(
                    "INSERT INTO leases VALUES (?, ?, ?, ?, ?, ?)", (run_key, tenant, pool, granted, now, now + ttl)
                )
                if hosts:
                    self._bind(con, run_key, pool, hosts, chips, now)
            else:
                granted = mine[0]
                con.execute("UPDATE leases SET expires=? WHERE run_key=?", (now + ttl, run_key))
            return Lease(run_key, tenant, pool, granted, now, now + ttl, self._hosts_of(con, run_key))

    def request(
        self,
        run_key: str,
        *,
        tenant: str,
        pool: str,
        nodes: int,
        ttl: float,
        up_to: int | None = None,
        priority: int = 0,
        preemptible: bool = False,
        estimate: float | None = None,
        chips: int = 1,
        now: float | None = None,
    ) -> "Lease | Waiting":
        """Admit the gang in its turn: it is granted (as ``admit``) when the pool's queue
        order lets it start and it fits; otherwise it waits in the pool's queue and the
        answer says where and why. Call again to renew the wait and to be admitted once
        capacity frees (idempotent; a granted run gets its lease back).

        The decision is ``trainflow.sched.decide`` (the code the trace simulator runs) over
        the pool's nodes. Without quotas, the pool's policy (``set_pool``); by default
        ``priority``: higher priority first, first come first served within a priority, and
        a gang that does not fit blocks the ones behind it, so a large gang is never starved
        by a stream of small ones. ``backfill``: first come first served, and a later run
        with an ``estimate`` (seconds from admission to release) starts early when it ends
        before the first waiting gang's reservation, or fits in nodes the reservation leaves
        spare; the reservation comes from the running runs' estimates. With
        quotas (``set_quota``), ``fairshare``: runs within their tenant's quota first, the
        least-served tenant first, idle quota lent to others; while a run within its quota
        waits, nobody borrows.

        Preemption: a run admitted with ``preemptible`` may be stopped for a waiting run of
        higher priority (or, with quotas, for a run within its quota while it borrows). The
        decision marks it (``preemption``); its node tasks checkpoint, stop and give the
        lease back with ``yield_lease``, which requeues it with its first submission time;
        the waiting run is granted once the nodes are free. Other runs keep their nodes.

        Raises:
            SpecError: the pool is unknown or smaller than the request (it would never fit).
        """
        now = time.time() if now is None else now
        up_to = max(nodes, up_to or nodes)
        with self._transaction() as con:
            capacity = self._fitting_capacity(con, pool, nodes, now, chips)
            if con.execute("SELECT 1 FROM leases WHERE run_key=?", (run_key,)).fetchone():
                con.execute("UPDATE leases SET expires=? WHERE run_key=?", (now + ttl, run_key))
                granted = con.execute("SELECT nodes FROM leases WHERE run_key=?", (run_key,)).fetchone()[0]
                return Lease(run_key, tenant, pool, granted, now, now + ttl, self._hosts_of(con, run_key))
            con.execute("DELETE FROM waiting WHERE seen < ?", (now - STALE_WAIT_S,))
            first = con.execute("SELECT submitted FROM waiting WHERE run_key=?", (run_key,)).fetchone()
            if estimate:
                con.execute(
                    "INSERT INTO estimates VALUES (?, ?) ON CONFLICT(run_key) DO UPDATE SET seconds=excluded.seconds",
                    (run_key, float(estimate)),
                )
            con.execute(
                "INSERT INTO waiting VALUES (?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT(run_key) DO UPDATE SET "
                "seen=excluded.seen, nodes=excluded.nodes, up_to=excluded.up_to, "
                "priority=excluded.priority",
                (run_key, tenant, pool, nodes, up_to, priority, now, now),
            )
            waiting = con.execute(
                "SELECT run_key, tenant, nodes, priority, submitted FROM waiting WHERE pool=?", (pool,)
            ).fetchall()
            leases = con.execute("SELECT run_key, tenant, nodes, granted FROM leases WHERE pool=?", (pool,)).fetchall()
            offline = self._offline(con, pool, now)
            free = capacity - offline - sum(r[2] for r in leases)
            quotas = dict(con.execute("SELECT tenant, nodes FROM quotas WHERE pool=?", (pool,)).fetchall())
            start, why, preempt = _admissions(
                capacity,
                offline,
                leases,
                waiting,
                now,
                quotas,
                self._preemptible(con, [r[0] for r in leases]),
                self._policy(con, pool),
                self._estimates(con, pool),
            )
            for victim, (by, reason) in preempt.items():
                con.execute(
                    "INSERT INTO preemptions VALUES (?, ?, ?, ?, ?) ON CONFLICT(run_key) DO NOTHING",
                    (victim, pool, by, now, reason),
                )
            if run_key in start:
                ahead = sum(start[k] for k in start if k != run_key)  # granted in this same decision
                granted = nodes + max(0, min(up_to - nodes, free - ahead - nodes))
                hosts = None
                if self._host_pool(con, pool):
                    granted, hosts = self._place_gang(con, pool, nodes, granted, chips)
                    if hosts is None:  # its turn, but no set of free hosts holds the gang
                        return Waiting(run_key, pool, 1, f"pool {pool!r}: {self._no_room(con, pool, nodes, chips)}")
                con.execute("DELETE FROM waiting WHERE run_key=?", (run_key,))
                con.execute(
                    "INSERT INTO leases VALUES (?, ?, ?, ?, ?, ?)", (run_key, tenant, pool, granted, now, now + ttl)
                )
                if hosts:
                    self._bind(con, run_key, pool, hosts, chips, now)
                if preemptible:
                    con.execute(
                        "INSERT INTO preemptible VALUES (?, ?, ?) ON CONFLICT(run_key) DO UPDATE SET "
                        "priority=excluded.priority, submitted=excluded.submitted",
                        (run_key, priority, first[0] if first else now),
                    )
                return Lease(run_key, tenant, pool, granted, now, now + ttl, tuple(hosts or ()))
            position, reason = why[run_key]
            return Waiting(run_key, pool, position, f"pool {pool!r}: {reason}")

    def queue(self, pool: str) -> list[str]:
        """The pool's waiting runs in admission order (the order ``request`` decides in: by
        priority, or by fair share where the pool has quotas)."""
        now = time.time()
        with closing(self._connect()) as con:
            waiting = con.execute(
                "SELECT run_key, tenant, nodes, priority, submitted FROM waiting "
                "WHERE pool=? ORDER BY priority DESC, submitted, run_key",
                (pool,),
            ).fetchall()
            if not waiting:
                return []
            leases = con.execute("SELECT run_key, tenant, nodes, granted FROM leases WHERE pool=?", (pool,)).fetchall()
            quotas = dict(con.execute("SELECT tenant, nodes FROM quotas WHERE pool=?", (pool,)).fetchall())
            capacity, offline = self._capacity(con, pool), self._offline(con, pool, now)
            running = self._preemptible(con, [r[0] for r in leases])
            policy = self._policy(con, pool)
        if policy in ("fifo", "backfill"):  # arrival order; backfill may start later ones early
            return [r[0] for r in sorted(waiting, key=lambda r: (r[4], r[0]))]
        if not quotas:
            return [r[0] for r in waiting]
        start, why, _ = _admissions(capacity, offline, leases, waiting, now, quotas, running)
        return sorted((r[0] for r in waiting), key=lambda k: (k not in start, why.get(k, (0,))[0]))

    def grow(
        self, run_key: str, *, by: int = 1, slot: int | None = None, host: str | None = None, now: float | None = None
    ) -> bool:
        """Add ``by`` nodes to the run's lease if they are free now; False otherwise (or if
        the run holds no lease). In a pool of registered hosts a node is a host for one
        ``slot``: ``host`` (the one the slot's task runs on) if it is free and healthy,
        else, without ``host``, a free one placed next to the run's other hosts."""
        now = time.time() if now is None else now
        with self._transaction() as con:
            row = con.execute("SELECT pool FROM leases WHERE run_key=? AND expires >= ?", (run_key, now)).fetchone()
            if row is None:
                return False
            pool = row[0]
            free = self._capacity(con, pool) - self._offline(con, pool, now) - self._used(con, pool)
            if free < by:
                return False
            if self._host_pool(con, pool):
                if by != 1 or slot is None:
                    raise ValueError("a pool of registered hosts grows a run one slot at a time: give slot=")
                chips = self._chips_of(con, run_key)
                if host is not None:
                    placed = (
                        [host] if any(h == host and d >= chips for h, d, _ in self._free_hosts(con, pool)) else None
                    )
                else:
                    placed = self._place_hosts(con, pool, 1, chips, near=self._hosts_of(con, run_key))
                if not placed:
                    return False
                self._bind(con, run_key, pool, placed, chips, now, first_slot=slot)
            con.execute("UPDATE leases SET nodes = nodes + ? WHERE run_key=?", (by, run_key))
            return True

    # -- placement on registered hosts ----------------------------------------------------

    @staticmethod
    def _host_pool(con, pool: str) -> bool:
        """A pool of registered hosts (no ``set_pool`` size): its nodes are placed on hosts."""
        if con.execute("SELECT 1 FROM pools WHERE name=?", (pool,)).fetchone():
            return False
        return con.execute("SELECT 1 FROM inventory WHERE pool=? LIMIT 1", (pool,)).fetchone() is not None

    @staticmethod
    def _free_hosts(con, pool: str) -> list[tuple[str, int, str | None]]:
        """The pool's hosts that are registered, not cordoned and held by no run: (host,
        chips, rack label)."""
        rows = con.execute(
            "SELECT host, devices, labels FROM inventory WHERE pool=? "
            "AND host NOT IN (SELECT host FROM cordons) "
            "AND host NOT IN (SELECT host FROM host_leases) ORDER BY host",
            (pool,),
        ).fetchall()
        return [(h, int(d), _rack(labels)) for h, d, labels in rows]

    @classmethod
    def _place_hosts(cls, con, pool: str, count: int, chips: int, near=()) -> list[str] | None:
        """``count`` free hosts with ``chips`` chips or more (``trainflow.sched.capacity.place``:
        fewest racks, best fit), those in the racks of the hosts ``near`` first; None if
        there are not that many. Listed by rack, then name (a rack's hosts get adjacent
        slots, so adjacent ranks)."""
        candidates = cls._free_hosts(con, pool)
        if near:
            marks = ", ".join("?" * len(near))
            racks = {
                _rack(r[0]) for r in con.execute(f"SELECT labels FROM inventory WHERE host IN ({marks})", tuple(near))
            } - {None}
            if racks:
                placed = cls._place_hosts_in([c for c in candidates if c[2] in racks], count, chips)
                if placed:
                    return placed
        return cls._place_hosts_in(candidates, count, chips)

    @staticmethod
    def _place_hosts_in(candidates, count: int, chips: int) -> list[str] | None:
        from trainflow.sched.capacity import FreeMap, place

        if count <= 0 or len(candidates) < count:
            return None
        free = FreeMap([d for _, d, _ in candidates], max(d for _, d, _ in candidates))
        racks = [r for _, _, r in candidates]
        chosen = place(free, count, chips, racks if any(r is not None for r in racks) else None)
        if chosen is None:
            return None
        return [h for r, h in sorted((candidates[i][2] or "", candidates[i][0]) for i in chosen)]

    @classmethod
    def _place_gang(cls, con, pool: str, nodes: int, granted: int, chips: int):
        """Hosts for a gang of ``nodes`` to ``granted`` nodes: the most that can be placed
        (at least ``nodes``) and where; ``(granted, None)`` if not even ``nodes`` fit."""
        for count in range(granted, nodes - 1, -1):
            hosts = cls._place_hosts(con, pool, count, chips)
            if hosts:
                return count, hosts
        return granted, None

    @classmethod
    def _no_room(cls, con, pool: str, nodes: int, chips: int) -> str:
        fit = sum(d >= chips for _, d, _ in cls._free_hosts(con, pool))
        return (
            f"needs {nodes} host{'s' * (nodes != 1)} with {chips} chip{'s' * (chips != 1)} or more; "
            f"{fit} free host{'s' * (fit != 1)} of the pool {'have' if fit != 1 else 'has'} that many"
        )

    @staticmethod
    def _bind(con, run_key: str, pool: str, hosts, chips: int, now: float, first_slot: int = 0) -> None:
        dag_run = run_key.split("/", 1)[1] if "/" in run_key else run_key
        for i, host in enumerate(hosts):
            con.execute(
                "INSERT INTO host_leases (host, run_key, dag_run, slot, pool, chips, since, routed_try) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, 0)",
                (host, run_key, dag_run, first_slot + i, pool, chips, now),
            )

    @staticmethod
    def _hosts_of(con, run_key: str) -> tuple[str, ...]:
        return tuple(
            r[0]
            for r in con.execute("SELECT host FROM host_leases WHERE run_key=? AND slot >= 0 ORDER BY slot", (run_key,))
        )

    @staticmethod
    def _chips_of(con, run_key: str) -> int:
        row = con.execute("SELECT MAX(chips) FROM host_leases WHERE run_key=?", (run_key,)).fetchone()
        return int(row[0]) if row and row[0] else 1

    @staticmethod
    def _sweep_hosts(con) -> int:
        """Free the hosts of runs that hold no lease any more (released, expired, yielded)."""
        return con.execute("DELETE FROM host_leases WHERE run_key NOT IN (SELECT run_key FROM leases)").rowcount

    @staticmethod
    def _suspect(con, host: str, run_key: str, slot: int, routed: int, lost) -> bool:
        if (
            con.execute("SELECT 1 FROM cordons WHERE host=?", (host,)).fetchone()
            or not con.execute("SELECT 1 FROM inventory WHERE host=?", (host,)).fetchone()
        ):
            return True
        if lost is None:
            from trainflow.cluster.nodes import try_lost
            from trainflow.workspace import default_root

            return try_lost(default_root() / run_key, slot, routed)
        return bool(lost(run_key, slot, routed))

    def placement(self, run_key: str) -> dict[int, str]:
        """The run's node slots and their hosts (empty outside pools of registered hosts)."""
        with closing(self._connect()) as con:
            return dict(
                con.execute("SELECT slot, host FROM host_leases WHERE run_key=? AND slot >= 0", (run_key,)).fetchall()
            )

    def route(
        self, dag_id: str, run_id: str, slot: int, try_number: int, now: float | None = None, lost=None
    ) -> str | None:
        """The host a try of node task ``slot`` of a DAG run must run on, or None when the
        slot holds no host (a pool sized by ``set_pool``, or an elastic slot still waiting
        for capacity: it goes to its chip queue, and ``grow`` binds the host it runs on).

        A later try than the one last routed (Airflow's retry) moves to a free healthy
        host, in the run's racks first, when its host is suspect: the try before it was
        lost there (``lost(run_key, slot, try)``, default ``trainflow.cluster.nodes.try_lost``
        on the run's workspace: it never began or never ended), or the host is cordoned or
        no longer registered. The suspect host goes back to the pool. A try that failed in
        order (its gang restarted) stays on its host, and so does a retry when no host is
        free.
        """
        now = time.time() if now is None else now
        with self._transaction() as con:
            row = con.execute(
                "SELECT host, run_key, pool, chips, routed_try FROM host_leases WHERE dag_run=? AND slot=?",
                (f"{dag_id}/{run_id}", slot),
            ).fetchone()
            if row is None:
                return None
            host, run_key, pool, chips, routed = row
            if routed and try_number > routed and self._suspect(con, host, run_key, slot, routed, lost):
                others = tuple(h for h in self._hosts_of(con, run_key) if h != host)
                moved = self._place_hosts(con, pool, 1, chips, near=others or (host,))
                if moved:
                    con.execute("DELETE FROM host_leases WHERE host=?", (host,))
                    self._bind(con, run_key, pool, moved, chips, now, first_slot=slot)
                    host = moved[0]
                else:
                    log.warning(
                        "%s node %d: host %s is suspect and no other host of pool %s is free; try %d waits for it",
                        run_key,
                        slot,
                        host,
                        pool,
                        try_number,
                    )
            con.execute("UPDATE host_leases SET routed_try=? WHERE host=?", (try_number, host))
            return host

    def lose_node(self, run_key: str, *, until: float, reason: str, slot: int | None = None) -> None:
        """One node of the run's lease is gone (its host failed): the lease shrinks by one
        and the pool counts the node offline until ``until`` or the run's ``release``,
        whichever comes first (past that, the pool's size is its operator's to set). In a
        pool of registered hosts, ``slot``'s host is held, out of placement, until then."""
        with self._transaction() as con:
            row = con.execute("SELECT pool FROM leases WHERE run_key=?", (run_key,)).fetchone()
            if row is None:
                return
            con.execute(
                "UPDATE leases SET nodes = CASE WHEN nodes > 0 THEN nodes - 1 ELSE 0 END WHERE run_key=?", (run_key,)
            )
            if slot is not None:  # its host stays out of placement until the run releases
                con.execute("UPDATE host_leases SET slot=-1 WHERE run_key=? AND slot=?", (run_key, slot))
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

    def _fitting_capacity(self, con, pool: str, nodes: int, now: float, chips: int = 1) -> int:
        """The pool's size, once a request of ``nodes`` (of ``chips`` each, in a pool of
        registered hosts) is known to fit it when idle (expired leases are dropped on the way)."""
        capacity = self._capacity(con, pool)
        if nodes > capacity:
            raise SpecError(
                "nodes", nodes, f"pool {pool!r} has only {capacity} nodes in total; ask for at most {capacity}"
            )
        if chips > 1 and self._host_pool(con, pool):
            sizes = [
                r[0]
                for r in con.execute(
                    "SELECT devices FROM inventory WHERE pool=? AND host NOT IN (SELECT host FROM cordons)", (pool,)
                )
            ]
            if not any(d >= chips for d in sizes):
                raise SpecError(
                    "nproc_per_node",
                    chips,
                    f"no healthy host of pool {pool!r} has {chips} chips "
                    f"(the most: {max(sizes, default=0)}); ask for at most {max(sizes, default=0)}",
                )
            fit = sum(d >= chips for d in sizes)
            if nodes > fit:
                raise SpecError(
                    "nodes",
                    nodes,
                    f"pool {pool!r} has only {fit} hosts with {chips} chips or more (healthy); ask for at most {fit}",
                )
        con.execute("DELETE FROM leases WHERE expires < ?", (now,))
        self._sweep_hosts(con)
        return capacity

    @staticmethod
    def _capacity(con, pool: str) -> int:
        """The pool's size: its ``set_pool`` size, else its registered hosts that are not
        cordoned (``trainflow doctor --register --pool``, ``trainflow worker``)."""
        row = con.execute("SELECT nodes FROM pools WHERE name=?", (pool,)).fetchone()
        if row is not None:
            return row[0]
        registered, healthy = con.execute(
            "SELECT COUNT(*), COALESCE(SUM(CASE WHEN host IN (SELECT host FROM cordons) THEN 0 ELSE 1 END), 0) "
            "FROM inventory WHERE pool=?",
            (pool,),
        ).fetchone()
        if registered:
            return healthy
        known = sorted(
            {r[0] for r in con.execute("SELECT name FROM pools")}
            | {r[0] for r in con.execute("SELECT DISTINCT pool FROM inventory WHERE pool != ''")}
        )
        raise SpecError("pool", pool, f"unknown pool; known pools: {', '.join(known) or 'none'}")

    @staticmethod
    def _used(con, pool: str) -> int:
        return con.execute("SELECT COALESCE(SUM(nodes), 0) FROM leases WHERE pool=?", (pool,)).fetchone()[0]

    @staticmethod
    def _offline(con, pool: str, now: float) -> int:
        return con.execute("SELECT COUNT(*) FROM offline WHERE pool=? AND until > ?", (pool, now)).fetchone()[0]

    @staticmethod
    def _estimates(con, pool: str) -> dict[str, float]:
        """Estimates of the pool's running and waiting runs: run key → seconds."""
        return dict(
            con.execute(
                "SELECT e.run_key, e.seconds FROM estimates e WHERE e.run_key IN (SELECT run_key FROM leases WHERE pool=?) "
                "OR e.run_key IN (SELECT run_key FROM waiting WHERE pool=?)",
                (pool, pool),
            ).fetchall()
        )

    @staticmethod
    def _preemptible(con, keys: list[str]) -> dict[str, tuple[int, float]]:
        """The preemptible ones among the runs ``keys``: run key → (priority, first submitted)."""
        if not keys:
            return {}
        rows = con.execute(
            "SELECT run_key, priority, submitted FROM preemptible WHERE run_key IN ("
            + ", ".join("?" * len(keys))
            + ")",
            keys,
        ).fetchall()
        return {key: (prio, submitted) for key, prio, submitted in rows}

    def preemption(self, run_key: str) -> dict | None:
        """The preemption ordered for ``run_key`` (``by``: the run it makes room for, ``at``,
        ``reason``), or None while it may keep its nodes."""
        with closing(self._connect()) as con:
            row = con.execute("SELECT by_key, at, reason FROM preemptions WHERE run_key=?", (run_key,)).fetchone()
        return None if row is None else {"by": row[0], "at": row[1], "reason": row[2]}

    def yield_lease(self, run_key: str, *, nodes: int, now: float | None = None) -> bool:
        """A preempted run gives its nodes back and goes back to its pool's queue, first in
        line among its priority by its first submission time. Idempotent: False if no
        preemption is ordered for it (another of its node tasks already yielded, or it was
        never preempted), which leaves any lease it holds alone.

        Args:
            nodes: the gang's size, which its requeued request asks for again.
        """
        now = time.time() if now is None else now
        with self._transaction() as con:
            if con.execute("DELETE FROM preemptions WHERE run_key=?", (run_key,)).rowcount == 0:
                return False
            lease = con.execute("SELECT tenant, pool FROM leases WHERE run_key=?", (run_key,)).fetchone()
            meta = con.execute("SELECT priority, submitted FROM preemptible WHERE run_key=?", (run_key,)).fetchone()
            con.execute("DELETE FROM leases WHERE run_key=?", (run_key,))
            con.execute("DELETE FROM offline WHERE run_key=?", (run_key,))
            con.execute("DELETE FROM host_leases WHERE run_key=?", (run_key,))
            if lease is not None:
                prio, submitted = meta if meta is not None else (0, now)
                con.execute(
                    "INSERT INTO waiting VALUES (?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT(run_key) DO NOTHING",
                    (run_key, lease[0], lease[1], nodes, nodes, prio, submitted, now),
                )
            return True

    def release(self, run_key: str, *, completed: tuple[str, int] | None = None, now: float | None = None) -> bool:
        """Free the run's lease (and the nodes it lost, ``lose_node``) or withdraw its waiting
        request; True if it held a lease. ``completed``: the run trained to the end, as
        ``(scope, steps)``: its time from admission to now joins the scope's history, which
        ``estimate`` reads (the newest ``HISTORY_KEEP`` per scope are kept)."""
        now = time.time() if now is None else now
        with self._transaction() as con:
            if completed is not None:
                scope, steps = completed
                row = con.execute("SELECT granted FROM leases WHERE run_key=?", (run_key,)).fetchone()
                if row is not None:
                    con.execute("INSERT INTO run_history VALUES (?, ?, ?, ?)", (scope, int(steps), now - row[0], now))
                    old = con.execute(
                        "SELECT ended FROM run_history WHERE scope=? ORDER BY ended DESC LIMIT 1 OFFSET ?",
                        (scope, HISTORY_KEEP - 1),
                    ).fetchone()
                    if old is not None:
                        con.execute("DELETE FROM run_history WHERE scope=? AND ended < ?", (scope, old[0]))
            con.execute("DELETE FROM estimates WHERE run_key=?", (run_key,))
            con.execute("DELETE FROM offline WHERE run_key=?", (run_key,))
            con.execute("DELETE FROM waiting WHERE run_key=?", (run_key,))
            con.execute("DELETE FROM preemptible WHERE run_key=?", (run_key,))
            con.execute("DELETE FROM preemptions WHERE run_key=?", (run_key,))
            con.execute("DELETE FROM host_leases WHERE run_key=?", (run_key,))
            return con.execute("DELETE FROM leases WHERE run_key=?", (run_key,)).rowcount > 0

    def release_gone(self, run_state: Callable[[str, str], str | None], *, now: float | None = None) -> list[dict]:
        """Free the nodes of runs Airflow no longer runs: a run deleted while it held a lease
        or waited (its release task never comes), or one that ended without that task.

        ``run_state(dag_id, run_id)`` is the run's Airflow state, None for a run that does
        not exist. A run that still runs, a key that is not ``tenant/dag/run``, or a state
        that cannot be read keeps its lease (the lease's expiry stays the backstop).

        Returns:
            One ``{"run_key", "why"}`` per run freed.
        """
        now = time.time() if now is None else now
        with closing(self._connect()) as con:
            keys = [r[0] for r in con.execute("SELECT run_key FROM leases WHERE expires >= ?", (now,))]
            keys += [r[0] for r in con.execute("SELECT run_key FROM waiting") if r[0] not in keys]
        freed = []
        for key in keys:
            parts = key.split("/", 2)
            if len(parts) != 3:
                continue
            try:
                state = run_state(parts[1], parts[2])
            except Exception as exc:  # noqa: BLE001 - unknown is not gone: keep the lease
                log.debug("state of %s unavailable: %s", key, exc)
                continue
            if state is not None and state not in ENDED_RUN_STATES:
                continue
            self.release(key, now=now)
            why = "the run was deleted" if state is None else f"the run is {state} and its release task did not run"
            log.warning("freed the nodes of %s: %s", key, why)
            freed.append({"run_key": key, "why": why})
        return freed

    def prune(self, now: float | None = None) -> dict[str, int]:
        """Delete rows that only accumulate (retention): expired leases, offline marks whose
        time passed, waiting requests nobody renews, and estimates, preemption marks and
        orders of runs that neither hold a lease nor wait. Returns counts per table."""
        now = time.time() if now is None else now
        live = "run_key NOT IN (SELECT run_key FROM leases) AND run_key NOT IN (SELECT run_key FROM waiting)"
        with self._transaction() as con:
            out = {
                "leases": con.execute("DELETE FROM leases WHERE expires < ?", (now,)).rowcount,
                "offline": con.execute("DELETE FROM offline WHERE until < ?", (now,)).rowcount,
                "waiting": con.execute("DELETE FROM waiting WHERE seen < ?", (now - STALE_WAIT_S,)).rowcount,
            }
            for table in ("estimates", "preemptible", "preemptions"):
                out[table] = con.execute(f"DELETE FROM {table} WHERE {live}").rowcount
            out["host_leases"] = self._sweep_hosts(con)
        return out

    def leases(self, pool: str | None = None, now: float | None = None) -> list[Lease]:
        now = time.time() if now is None else now
        with closing(self._connect()) as con:
            rows = con.execute(
                "SELECT * FROM leases WHERE expires >= ?" + (" AND pool=?" if pool else ""),
                (now, pool) if pool else (now,),
            ).fetchall()
            hosts = {}
            for host, key in con.execute("SELECT host, run_key FROM host_leases WHERE slot >= 0 ORDER BY slot"):
                hosts.setdefault(key, []).append(host)
        return [Lease(*r, hosts=tuple(hosts.get(r[0], ()))) for r in rows]
