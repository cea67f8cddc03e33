"""A node task's side of a preemption: hear the allocator's order, have the gang stop at a
checkpoint, give the nodes back and requeue, then clear the way for the resume.

The allocator decides (``Allocator.request`` marks a preemptible run for a waiting one of
higher priority, or for a quota reclaim) and the run's node tasks carry it out:

1. ``poll`` (from the node task's watch loop) sees the order and writes
   ``control/preempt-request.json``; the gang's rank 0 reads it at its next check
   (``worker.train.preempt_point``), every rank commits a checkpoint of the same step and
   the workers exit cleanly, rank 0 having written ``control/preempted.json``.
2. ``requeue``: the first node task to get there gives the lease back and puts the run back
   in its pool's queue with its first submission time (``Allocator.yield_lease``); the
   others find nothing left to do. Each node task then waits, deferred, for re-admission.
3. ``resumed``: once admitted again the control files go and the gang starts as after any
   restart, from the newest verified checkpoint: the one it stopped at.

A gang that does not stop within ``grace`` seconds of the order (a hung collective, a save
that keeps failing) is killed by its node tasks, and resumes from its newest verified
checkpoint like after a fault. Airflow-free.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from trainflow.cluster.allocator import Allocator
from trainflow.timeline import record
from trainflow.workspace import PREEMPT_REQUEST, PREEMPTED, preempted, write_json_atomic

DEFAULT_GRACE_S = 120.0
CHECK_EVERY_S = 1.0


def grace_from_env(env: dict[str, str] | None = None) -> float:
    """``TRAINFLOW_PREEMPT_GRACE_S``: seconds a gang has to stop after a preemption order."""
    env = os.environ if env is None else env
    return float(env.get("TRAINFLOW_PREEMPT_GRACE_S", DEFAULT_GRACE_S))


class PreemptionWatch:
    """Node ``node``'s watch over preemption orders for the run in ``run_dir``."""

    def __init__(
        self,
        run_dir: Path | str,
        run_key: str,
        node: int,
        *,
        allocator: Allocator | None = None,
        grace: float | None = None,
        check_every: float = CHECK_EVERY_S,
    ) -> None:
        self.run_dir, self.run_key, self.node = Path(run_dir), run_key, node
        self.allocator = allocator or Allocator()
        self.grace = grace_from_env() if grace is None else grace
        self.check_every = check_every
        self._checked = 0.0
        self.order: dict | None = None
        self.request: dict | None = None  # the run's Allocator.request arguments (its node task sets them)

    @property
    def request_file(self) -> Path:
        return self.run_dir / "control" / PREEMPT_REQUEST

    def poll(self, now: float | None = None) -> str | None:
        """Pass an order on to the gang (at most one allocator read per ``check_every``);
        a reason to kill the gang once it has had ``grace`` seconds to stop; else None."""
        now = time.time() if now is None else now
        if now - self._checked < self.check_every:
            return self._overdue(now)
        self._checked = now
        order = self.allocator.preemption(self.run_key)
        if order is None:
            return None
        if self.order is None:
            self.order = order
            record(self.run_dir, "preempt_ordered", node=self.node, by=order["by"], reason=order["reason"])
        if not self.request_file.exists() and preempted(self.run_dir) is None:
            self.request_file.parent.mkdir(parents=True, exist_ok=True)
            write_json_atomic(self.request_file, order)
        return self._overdue(now)

    def _overdue(self, now: float) -> str | None:
        if self.order is None or now - float(self.order["at"]) < self.grace:
            return None
        return (
            f"preempted for {self.order['by']!r}, but the gang did not stop at a checkpoint within "
            f"{self.grace:.0f} s (TRAINFLOW_PREEMPT_GRACE_S); stopping it: it resumes from its newest "
            f"verified checkpoint"
        )

    def stopped_at(self) -> int | None:
        """The step the gang stopped at for the preemption (None: it did not stop for one)."""
        info = preempted(self.run_dir)
        return int(info["step"]) if info and "step" in info else None

    def ordered(self) -> bool:
        """Whether a preemption was ordered for the run (still pending, or carried out)."""
        return (
            self.order is not None
            or self.allocator.preemption(self.run_key) is not None
            or preempted(self.run_dir) is not None
        )

    def holds_lease(self, now: float | None = None) -> bool:
        """Whether the run holds its lease now (False once it gave it back to requeue)."""
        return any(lease.run_key == self.run_key for lease in self.allocator.leases(now=now))

    def requeue(self, nodes: int) -> bool:
        """Give the run's nodes back and requeue it (True for the node task that did)."""
        done = self.allocator.yield_lease(self.run_key, nodes=nodes)
        if done:
            record(self.run_dir, "requeued", node=self.node, step=self.stopped_at())
        return done

    def resumed(self, waited_s: float) -> None:
        """Admitted again: clear the control files so the gang trains on (idempotent)."""
        cleared = False
        for name in (PREEMPTED, PREEMPT_REQUEST):
            path = self.run_dir / "control" / name
            cleared |= path.exists()
            path.unlink(missing_ok=True)
        self.order = None
        if cleared:  # the first of the run's node tasks back
            record(self.run_dir, "readmitted", node=self.node, waited_s=round(waited_s, 3))
