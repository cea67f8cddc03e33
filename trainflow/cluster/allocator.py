"""All-or-nothing gang admission with expiring leases, in trainflow's own database.

The embedded default is SQLite under ``$TRAINFLOW_HOME`` (never Airflow's tables). A run
asks for N nodes of a pool; it gets all of them or none. Leases expire as a backstop, so
a crashed run never holds capacity for ever; ``release`` is idempotent.
"""

from __future__ import annotations

import os
import sqlite3
import time
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path

from trainflow.errors import AdmissionError, SpecError

_SCHEMA = """
CREATE TABLE IF NOT EXISTS pools (name TEXT PRIMARY KEY, nodes INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS leases (
    run_key TEXT PRIMARY KEY, tenant TEXT NOT NULL, pool TEXT NOT NULL,
    nodes INTEGER NOT NULL, granted REAL NOT NULL, expires REAL NOT NULL
);
"""


@dataclass(frozen=True)
class Lease:
    run_key: str
    tenant: str
    pool: str
    nodes: int
    granted: float
    expires: float


def default_db() -> Path:
    home = os.environ.get("TRAINFLOW_HOME") or os.path.join(os.path.expanduser("~"), ".trainflow")
    return Path(home) / "state.db"


def embedded_capacity() -> int:
    """Node slots of the embedded pool (this machine): ``TRAINFLOW_EMBEDDED_NODES``, default 4."""
    return int(os.environ.get("TRAINFLOW_EMBEDDED_NODES", "4"))


class StateDB:
    """A table set in trainflow's SQLite database (WAL, autocommit; explicit
    ``BEGIN IMMEDIATE`` where a read-modify-write must be atomic); safe across processes.
    Subclasses name their ``SCHEMA``."""

    SCHEMA = ""

    def __init__(self, db: Path | None = None) -> None:
        self.db = Path(db or default_db())
        self.db.parent.mkdir(parents=True, exist_ok=True)
        with closing(self._connect()) as con:
            con.executescript(self.SCHEMA)

    def _connect(self) -> sqlite3.Connection:
        con = sqlite3.connect(self.db, timeout=30, isolation_level=None)
        con.execute("PRAGMA journal_mode=WAL")
        return con


class Allocator(StateDB):
    """Gang allocator over trainflow's SQLite database; safe across processes."""

    SCHEMA = _SCHEMA

    def set_pool(self, name: str, nodes: int) -> None:
        with closing(self._connect()) as con:
            con.execute("INSERT INTO pools VALUES (?, ?) ON CONFLICT(name) DO UPDATE SET nodes=excluded.nodes",
                        (name, nodes))

    def admit(self, run_key: str, *, tenant: str, pool: str, nodes: int, ttl: float,
              now: float | None = None) -> Lease:
        """Grant ``nodes`` of ``pool`` to ``run_key`` all-or-nothing (idempotent per run).

        Raises:
            SpecError: the pool is unknown or smaller than the request (it would never fit).
            AdmissionError: not enough free nodes right now.
        """
        now = time.time() if now is None else now
        with closing(self._connect()) as con:
            con.execute("BEGIN IMMEDIATE")
            try:
                row = con.execute("SELECT nodes FROM pools WHERE name=?", (pool,)).fetchone()
                if row is None:
                    known = [r[0] for r in con.execute("SELECT name FROM pools ORDER BY name")]
                    raise SpecError("pool", pool, f"unknown pool; known pools: {', '.join(known) or 'none'}")
                capacity = row[0]
                if nodes > capacity:
                    raise SpecError("nodes", nodes, f"pool {pool!r} has only {capacity} nodes in total; "
                                    f"ask for at most {capacity}")
                con.execute("DELETE FROM leases WHERE expires < ?", (now,))
                mine = con.execute("SELECT nodes FROM leases WHERE run_key=?", (run_key,)).fetchone()
                if mine is None:
                    used = con.execute("SELECT COALESCE(SUM(nodes), 0) FROM leases WHERE pool=?",
                                       (pool,)).fetchone()[0]
                    if used + nodes > capacity:
                        raise AdmissionError(f"pool {pool!r}: {nodes} nodes asked, "
                                             f"{capacity - used} of {capacity} free")
                    con.execute("INSERT INTO leases VALUES (?, ?, ?, ?, ?, ?)",
                                (run_key, tenant, pool, nodes, now, now + ttl))
                else:
                    con.execute("UPDATE leases SET expires=? WHERE run_key=?", (now + ttl, run_key))
                con.execute("COMMIT")
            except BaseException:
                con.execute("ROLLBACK")
                raise
        return Lease(run_key, tenant, pool, nodes, now, now + ttl)

    def release(self, run_key: str) -> bool:
        """Free the run's lease; True if there was one."""
        with closing(self._connect()) as con:
            return con.execute("DELETE FROM leases WHERE run_key=?", (run_key,)).rowcount > 0

    def leases(self, pool: str | None = None, now: float | None = None) -> list[Lease]:
        now = time.time() if now is None else now
        with closing(self._connect()) as con:
            rows = con.execute("SELECT * FROM leases WHERE expires >= ?" + (" AND pool=?" if pool else ""),
                               (now, pool) if pool else (now,)).fetchall()
        return [Lease(*r) for r in rows]
