"""The torch side of the database rendezvous (``trainflow.launch.rdzv_db``): torch
elastic's ``RendezvousBackend`` and ``Store`` on the database, and the handler factory
registered as ``rdzv_backend="trainflow-db"``. Importing it loads torch."""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path

from trainflow.launch.rdzv_db import _UPSERT, BACKEND, POLL_S, _connect, _transaction, database, ensure_schema


def _backend_base():
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousBackend

    return RendezvousBackend


def _store_base():
    import torch.distributed as dist

    return dist.Store


class DBRendezvousBackend(_backend_base()):
    """Rendezvous state by compare-and-set on ``rdzv_state.version`` (the fencing token)."""

    def __init__(self, db: Path | str, run_id: str) -> None:
        self.db, self.run_id = db, run_id
        ensure_schema(self.db)
        self._con = _connect(self.db)

    @property
    def name(self) -> str:
        return BACKEND

    def get_state(self) -> tuple[bytes, int] | None:
        row = self._con.execute("SELECT state, version FROM rdzv_state WHERE run_id = ?", (self.run_id,)).fetchone()
        return None if row is None else (bytes(row[0]), row[1])

    def set_state(self, state: bytes, token: int | None = None) -> tuple[bytes, int, bool]:
        with _transaction(self._con) as con:
            if token is None:
                written = (
                    con.execute(
                        "INSERT INTO rdzv_state VALUES (?, ?, 1) ON CONFLICT DO NOTHING", (self.run_id, state)
                    ).rowcount
                    == 1
                )
            else:
                written = (
                    con.execute(
                        "UPDATE rdzv_state SET state = ?, version = version + 1 WHERE run_id = ? AND version = ?",
                        (state, self.run_id, token),
                    ).rowcount
                    == 1
                )
            row = con.execute("SELECT state, version FROM rdzv_state WHERE run_id = ?", (self.run_id,)).fetchone()
        return bytes(row[0]), row[1], written


class DBStore(_store_base()):
    """A ``torch.distributed.Store`` on the database: what torch elastic's agents need
    (set, get, add, compare_set, wait, check, multi_get/multi_set, delete_key).

    ``get`` and ``wait`` block, polling every ``POLL_S``, until the keys exist or the
    store's timeout passes, then raise ``DistStoreError`` (as TCPStore does)."""

    def __init__(self, db: Path | str, run_id: str, timeout: timedelta = timedelta(seconds=300)) -> None:
        super().__init__()  # the pybind trampoline needs it
        self.db, self.run_id = db, run_id
        ensure_schema(self.db)
        self._con = _connect(self.db)
        self.set_timeout(timeout)

    # -- reads and writes -------------------------------------------------------------
    def _read(self, keys: list[str]) -> dict[str, bytes]:
        if not keys:
            return {}
        marks = ",".join("?" * len(keys))
        rows = self._con.execute(
            f"SELECT key, value FROM rdzv_kv WHERE run_id = ? AND key IN ({marks})", (self.run_id, *keys)
        ).fetchall()
        return {k: bytes(v) for k, v in rows}

    def _await(self, keys: list[str], timeout: timedelta | None = None) -> dict[str, bytes]:
        limit = (timeout or self.timeout).total_seconds()
        deadline = time.monotonic() + (limit if limit > 0 else float("inf"))
        while True:
            found = self._read(keys)
            if len(found) == len(set(keys)):
                return found
            if time.monotonic() > deadline:
                from torch.distributed import DistStoreError

                missing = sorted(set(keys) - set(found))
                raise DistStoreError(f"rendezvous store {self.run_id}: keys {missing} not set within {limit:g}s")
            time.sleep(POLL_S)

    @staticmethod
    def _bytes(value) -> bytes:
        return value.encode() if isinstance(value, str) else bytes(value)

    def set(self, key: str, value) -> None:
        self._con.execute(_UPSERT, (self.run_id, key, self._bytes(value)))

    def multi_set(self, keys: list[str], values: list) -> None:
        with _transaction(self._con) as con:
            con.executemany(_UPSERT, [(self.run_id, k, self._bytes(v)) for k, v in zip(keys, values, strict=True)])

    def get(self, key: str) -> bytes:
        return self._await([key])[key]

    def multi_get(self, keys: list[str]) -> list[bytes]:
        found = self._await(list(keys))
        return [found[k] for k in keys]

    def add(self, key: str, amount: int) -> int:
        """Atomic add to an integer kept as ASCII digits (TCPStore's encoding)."""
        with _transaction(self._con) as con:
            row = con.execute("SELECT value FROM rdzv_kv WHERE run_id = ? AND key = ?", (self.run_id, key)).fetchone()
            value = (int(bytes(row[0])) if row else 0) + int(amount)
            con.execute(_UPSERT, (self.run_id, key, str(value).encode()))
        return value

    def compare_set(self, key: str, expected, desired) -> bytes:
        """Set ``key`` to ``desired`` if it holds ``expected`` (or is absent and ``expected``
        is empty); returns the value it holds afterwards (TCPStore's semantics)."""
        expected, desired = self._bytes(expected), self._bytes(desired)
        with _transaction(self._con) as con:
            row = con.execute("SELECT value FROM rdzv_kv WHERE run_id = ? AND key = ?", (self.run_id, key)).fetchone()
            current = None if row is None else bytes(row[0])
            if (current is None and expected == b"") or current == expected:
                con.execute(_UPSERT, (self.run_id, key, desired))
                current = desired
        return expected if current is None else current

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self._await(list(keys), timeout)

    def check(self, keys: list[str]) -> bool:
        return len(self._read(list(keys))) == len(set(keys))

    def delete_key(self, key: str) -> bool:
        return self._con.execute("DELETE FROM rdzv_kv WHERE run_id = ? AND key = ?", (self.run_id, key)).rowcount == 1


def create_handler(params):
    """torch elastic's handler factory for ``rdzv_backend="trainflow-db"``."""
    import types

    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler as create

    db = database(params.endpoint)
    timeout = timedelta(seconds=float(params.get("store_timeout", 300)))
    handler = create(DBStore(db, params.run_id, timeout), DBRendezvousBackend(db, params.run_id), params)
    if all(hasattr(handler, name) for name in ("_stop_heartbeats", "_op_executor", "_get_deadline", "_settings")):
        handler.shutdown = types.MethodType(_leave, handler)
    else:
        import logging

        logging.getLogger(__name__).warning(
            "torch elastic's rendezvous handler changed: an agent that ends will close the "
            "rendezvous (a retried node cannot rejoin)"
        )
    return handler


def _leave(handler) -> bool:
    """``shutdown`` that leaves the rendezvous and keeps it open (see the module doc)."""
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _RendezvousExitOp

    handler._stop_heartbeats()
    try:
        handler._op_executor.run(_RendezvousExitOp(), handler._get_deadline(handler._settings.timeout.close))
        return True
    except Exception:  # noqa: BLE001 - leaving is best effort: the keep-alive expires anyway
        return False


def register() -> None:
    """Make ``trainflow-db`` a rendezvous backend of torch elastic in this process (idempotent)."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    rendezvous_handler_registry.register(BACKEND, create_handler)
