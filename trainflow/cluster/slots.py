"""Which node slots of a run hold a node of the pool (capacity), in the run's workspace.

A run is planned with one slot per node of its full gang plus its hot spares
(``plan["nodes"]``). Provision admits between the run's minimum and that many nodes
(``Allocator.admit(..., up_to=)``) and marks the admitted slots as holding one
(``nodes/slot-<n>.held``); the other slots' tasks wait for capacity (``SlotLeases.acquire``)
and join the gang when they get it. A node whose host is lost for good (the ``lose_node``
fault, or an operator's word through ``mark_lost``) leaves a ``nodes/lost-<n>.json``: the
slot's next try gives that node back as offline (``settle_loss``: the lease shrinks, the
pool counts it offline until it returns) and then waits for capacity like any other.
Airflow-free; the shard_train operator drives it.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

from trainflow.cluster.allocator import Allocator
from trainflow.timeline import record
from trainflow.workspace import write_json_atomic

LEASE_FILE = "lease.json"


def mark_lost(run_dir: Path, node: int, *, seconds: float, reason: str) -> None:
    """Record that slot ``node``'s node is gone for ``seconds`` (0: for good)."""
    path = Path(run_dir) / "nodes" / f"lost-{node:04d}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    until = time.time() + seconds if seconds else math.inf
    write_json_atomic(
        path, {"node": node, "until": until if math.isfinite(until) else None, "reason": reason, "time": time.time()}
    )


class SlotLeases:
    """The capacity bookkeeping of one run's slots (``None`` from ``open`` for a run
    launched without an allocator, e.g. ``trainflow.launch.local``)."""

    def __init__(self, run_dir: Path, run_key: str, pool: str, allocator: Allocator | None = None) -> None:
        self.run_dir, self.run_key, self.pool = Path(run_dir), run_key, pool
        self.allocator = allocator or Allocator()
        self.nodes_dir = self.run_dir / "nodes"
        self.request: dict | None = None

    @classmethod
    def create(
        cls,
        run_dir: Path,
        run_key: str,
        pool: str,
        granted: int,
        allocator: Allocator | None = None,
        request: dict | None = None,
    ) -> "SlotLeases":
        """Provision's side: remember the lease (and ``request``, the ``Allocator.request``
        arguments it was granted for, which a preempted run asks again with) and mark slots
        ``0..granted-1`` as holding a node (stale markers of an earlier run with the same id
        are removed)."""
        leases = cls(run_dir, run_key, pool, allocator)
        leases.nodes_dir.mkdir(parents=True, exist_ok=True)
        for stale in [*leases.nodes_dir.glob("slot-*.held"), *leases.nodes_dir.glob("lost-*.json")]:
            stale.unlink()
        write_json_atomic(
            leases.nodes_dir / LEASE_FILE, {"run_key": run_key, "pool": pool, "granted": granted, "request": request}
        )
        for node in range(granted):
            leases._held(node).touch()
        return leases

    @classmethod
    def open(cls, run_dir: Path, allocator: Allocator | None = None) -> "SlotLeases | None":
        try:
            info = json.loads((Path(run_dir) / "nodes" / LEASE_FILE).read_text())
        except (OSError, ValueError):
            return None
        leases = cls(run_dir, info["run_key"], info["pool"], allocator)
        leases.request = info.get("request")
        return leases

    def _held(self, node: int) -> Path:
        return self.nodes_dir / f"slot-{node:04d}.held"

    def holds(self, node: int) -> bool:
        return self._held(node).exists()

    def settle_loss(self, node: int) -> dict | None:
        """If slot ``node``'s node was lost, give it back (lease − 1, the pool counts it
        offline until it returns) and return the loss record; else None."""
        lost = self.nodes_dir / f"lost-{node:04d}.json"
        try:
            info = json.loads(lost.read_text())
        except (OSError, ValueError):
            return None
        if self.holds(node):
            until = info.get("until")
            self.allocator.lose_node(
                self.run_key,
                until=math.inf if until is None else float(until),
                reason=f"{self.run_key} node {node}: {info.get('reason', 'lost')}",
                slot=node,
            )
            self._held(node).unlink(missing_ok=True)
            record(self.run_dir, "node_lost", node=node, until=until, reason=info.get("reason"))
        os.replace(lost, lost.with_suffix(".settled"))
        return info

    def acquire(self, node: int) -> bool:
        """Take one more node of the pool for slot ``node`` if one is free now."""
        if self.holds(node):
            return True
        from trainflow.cluster.hosts import host_name

        # In a pool of registered hosts the node is this host: the slot's task runs here.
        if not self.allocator.grow(self.run_key, slot=node, host=host_name()):
            return False
        self._held(node).touch()
        record(self.run_dir, "capacity_acquired", node=node)
        return True
