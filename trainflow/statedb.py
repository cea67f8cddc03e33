"""trainflow's own database: SQLite (embedded profile) or PostgreSQL (distributed).

One switch, ``TRAINFLOW_STATE_DB``: unset, a path or ``sqlite:////abs/path.db`` for SQLite
(default ``$TRAINFLOW_HOME/state.db``); ``postgresql://user@host:5432/trainflow`` for
PostgreSQL — its own database, never Airflow's tables. The allocator, the host registry
and the ``trainflow-db`` rendezvous all speak the same small SQL dialect through
``connect``: ``?`` placeholders, ``INSERT … ON CONFLICT …``, and ``BEGIN IMMEDIATE`` for a
read-modify-write that must be atomic (SQLite's database write lock; on PostgreSQL a
transaction holding one advisory lock, the same serialisation).
"""

from __future__ import annotations

import os
import re
import sqlite3
from pathlib import Path
from typing import Any, Iterable

# pg_advisory_xact_lock key of trainflow's write transactions ("trainflo" in ASCII).
LOCK_KEY = 0x747261696E666C6F


def default_target() -> str:
    """``TRAINFLOW_STATE_DB`` or ``$TRAINFLOW_HOME/state.db``."""
    if os.environ.get("TRAINFLOW_STATE_DB"):
        return os.environ["TRAINFLOW_STATE_DB"]
    home = os.environ.get("TRAINFLOW_HOME") or os.path.join(os.path.expanduser("~"), ".trainflow")
    return str(Path(home) / "state.db")


def is_postgres(target: str | Path) -> bool:
    return str(target).startswith(("postgresql://", "postgres://", "postgresql+psycopg2://"))


def sqlite_path(target: str | Path) -> Path:
    text = str(target)
    return Path(text[len("sqlite:///") :] if text.startswith("sqlite:///") else text)


def redact(target: str | Path) -> str:
    """The target without a password (for messages and logs)."""
    return re.sub(r"(://[^:/@]+):[^@]*@", r"\1:***@", str(target))


def _wal(con, timeout: float) -> None:
    """``PRAGMA journal_mode=WAL``, retried: switching a new database to WAL takes an
    exclusive lock, and SQLite answers "database is locked" at once, without its busy
    timeout, to the processes that open the same new database at that moment (the gang's
    agents opening the run's rendezvous database together; measured: 14 of 600 openings by
    3 processes at once)."""
    import random
    import time

    deadline = time.monotonic() + timeout
    while True:
        try:
            con.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(random.uniform(0.005, 0.05))


def connect(target: str | Path, *, timeout: float = 30.0):
    """An autocommit connection with ``execute``/``executemany``/``executescript``/``close``."""
    if is_postgres(target):
        return PGConnection(str(target), timeout=timeout)
    path = sqlite_path(target)
    path.parent.mkdir(parents=True, exist_ok=True)
    con = sqlite3.connect(path, timeout=timeout, isolation_level=None, check_same_thread=False)
    _wal(con, timeout)
    con.execute("PRAGMA synchronous=NORMAL")  # WAL: durable across process deaths, not power loss
    return con


_DDL_TYPES = ((re.compile(r"\bREAL\b"), "DOUBLE PRECISION"), (re.compile(r"\bBLOB\b"), "BYTEA"))


class PGConnection:
    """psycopg2 behind the sqlite3 connection interface trainflow uses."""

    def __init__(self, url: str, *, timeout: float = 30.0) -> None:
        import psycopg2

        url = url.replace("postgresql+psycopg2://", "postgresql://", 1)
        self._con = psycopg2.connect(url, connect_timeout=max(1, int(timeout)))
        self._con.autocommit = True

    def execute(self, sql: str, params: Iterable[Any] = ()):
        cur = self._con.cursor()
        if sql.strip().upper() == "BEGIN IMMEDIATE":
            cur.execute("BEGIN")
            cur.execute("SELECT pg_advisory_xact_lock(%s)", (LOCK_KEY,))
            return cur
        cur.execute(sql.replace("?", "%s"), tuple(_adapt(p) for p in params))
        return cur

    def executemany(self, sql: str, rows: Iterable[Iterable[Any]]):
        cur = self._con.cursor()
        cur.executemany(sql.replace("?", "%s"), [tuple(_adapt(p) for p in r) for r in rows])
        return cur

    def executescript(self, script: str) -> None:
        """DDL, with SQLite's types mapped, under the write lock (concurrent ``CREATE …
        IF NOT EXISTS`` races on PostgreSQL's catalog otherwise)."""
        for pattern, replacement in _DDL_TYPES:
            script = pattern.sub(replacement, script)
        cur = self._con.cursor()
        cur.execute("BEGIN")
        try:
            cur.execute("SELECT pg_advisory_xact_lock(%s)", (LOCK_KEY,))
            for stmt in (s.strip() for s in script.split(";")):
                if stmt:
                    cur.execute(stmt)
            cur.execute("COMMIT")
        except BaseException:
            cur.execute("ROLLBACK")
            raise

    def close(self) -> None:
        self._con.close()


def errors() -> tuple[type[BaseException], ...]:
    """The exceptions a database of either kind raises."""
    found: list[type[BaseException]] = [sqlite3.Error]
    try:
        import psycopg2

        found.append(psycopg2.Error)
    except ImportError:
        pass
    return tuple(found)


def _adapt(value: Any) -> Any:
    if isinstance(value, (bytes, bytearray, memoryview)):
        import psycopg2

        return psycopg2.Binary(bytes(value))
    return value
