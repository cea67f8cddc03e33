"""The gang's rendezvous on trainflow's own database: no node hosts it, none can take it down.

torch elastic's stock ``c10d`` rendezvous keeps its state in a TCPStore served by the
agent whose address is the endpoint; when that node dies, every other agent loses the
rendezvous and fails with it, so one node fault costs the whole gang its node tasks.
Here the state lives in a database every node reaches (in the embedded profile
``rendezvous.db`` in the run's workspace, SQLite in WAL mode), in two parts, as they must be:

- ``rdzv_store.DBRendezvousBackend``: torch's ``RendezvousBackend``, the rendezvous state blob
  set by compare-and-set on a version column (the fencing token);
- ``rdzv_store.DBStore``: a ``torch.distributed.Store`` on the same database, which the agents use
  for rank assignment and their exit barrier.

The workers' own store is rank 0's TCPStore of each round (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE``):
it lives as long as that round does. Rows are keyed by the rendezvous id and deleted
when the run ends (``purge``).

This module is the database side and needs no torch (a node's preflight opens the
database without loading it); ``trainflow.launch.rdzv_store`` holds the torch side.

Use: ``register()`` in the agent process, then ``rdzv_backend="trainflow-db"`` with the
database as the endpoint: ``sqlite:////abs/path.db`` (embedded) or a PostgreSQL URL
``postgresql://user@host/trainflow`` (distributed: every host reaches it, ``trainflow.statedb``).

One change to torch's handler: ``shutdown`` leaves the rendezvous instead of closing it.
torch closes a rendezvous for good when any agent ends, so a node task retried after its
agent gave up could never rejoin, and the closure would stop its healthy peers too; here
the gang stays open for the replacement, and the run's own records (abort, crash loop)
decide when a run is over.
"""

from __future__ import annotations

from contextlib import closing, contextmanager
from pathlib import Path

BACKEND = "trainflow-db"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS rdzv_state (
    run_id TEXT PRIMARY KEY, state BLOB NOT NULL, version INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS rdzv_kv (
    run_id TEXT NOT NULL, key TEXT NOT NULL, value BLOB NOT NULL, PRIMARY KEY (run_id, key)
);
"""

_UPSERT = "INSERT INTO rdzv_kv VALUES (?, ?, ?) ON CONFLICT(run_id, key) DO UPDATE SET value = excluded.value"

# Between reads of a key another agent has not written yet (the store's blocking get/wait).
POLL_S = 0.01


def endpoint(db: Path | str) -> str:
    """The rendezvous endpoint naming database ``db`` (a path, or a PostgreSQL URL)."""
    from trainflow.statedb import is_postgres

    return str(db) if is_postgres(db) else f"sqlite:///{Path(db).resolve()}"


def database(endpoint: str) -> Path | str:
    """The database an endpoint names (a path for SQLite, the URL for PostgreSQL).

    Raises:
        ValueError: neither a ``sqlite:///`` nor a ``postgresql://`` endpoint.
    """
    from trainflow.statedb import is_postgres

    if is_postgres(endpoint):
        return endpoint
    if not endpoint.startswith("sqlite:///"):
        raise ValueError(
            f"rendezvous endpoint {endpoint!r} is not a database trainflow-db can use: "
            f"expected sqlite:////absolute/path.db or postgresql://user@host/db"
        )
    return Path(endpoint[len("sqlite:///") :])


def reachable(endpoint: str, timeout: float = 5.0) -> str:
    """Open the database and read from it; returns a description (raises if it cannot)."""
    from trainflow.statedb import redact

    db = database(endpoint)
    ensure_schema(db)
    with closing(_connect(db, timeout=timeout)) as con:
        con.execute("SELECT COUNT(*) FROM rdzv_state").fetchone()
    return f"rendezvous database {redact(db)} answers"


def _connect(db: Path | str, timeout: float = 30.0):
    from trainflow.statedb import connect

    return connect(db, timeout=timeout)


@contextmanager
def _transaction(con):
    """A write transaction taken at once (``BEGIN IMMEDIATE``): committed, or rolled back on error."""
    con.execute("BEGIN IMMEDIATE")
    try:
        yield con
        con.execute("COMMIT")
    except BaseException:
        con.execute("ROLLBACK")
        raise


def ensure_schema(db: Path | str) -> None:
    with closing(_connect(db)) as con:
        con.executescript(_SCHEMA)


def purge(db: Path | str, run_id: str) -> int:
    """Delete a finished rendezvous' rows; returns how many went."""
    from trainflow.statedb import is_postgres

    if not is_postgres(db) and not Path(db).exists():
        return 0
    with closing(_connect(db)) as con:
        con.executescript(_SCHEMA)
        n = con.execute("DELETE FROM rdzv_kv WHERE run_id = ?", (run_id,)).rowcount
        return n + con.execute("DELETE FROM rdzv_state WHERE run_id = ?", (run_id,)).rowcount


def register() -> None:
    """Make ``trainflow-db`` a rendezvous backend of torch elastic in this process
    (idempotent; loads torch: ``trainflow.launch.rdzv_store``)."""
    from trainflow.launch import rdzv_store

    rdzv_store.register()
