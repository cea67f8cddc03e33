"""The scheduling model: a pool of nodes, gang requests, running allocations, decisions.

All frozen keyword-only dataclasses that validate in ``__post_init__`` (a ``SpecError``
naming the field, the value and the fix). Times are plain floats in seconds on whatever
clock the caller uses (the simulator's virtual clock, or wall time in production); nothing
here reads a clock.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Protocol

from trainflow.errors import SpecError


class Policy(str, enum.Enum):
    """How waiting requests are ordered and whether running ones may be preempted."""

    FIFO = "fifo"
    BACKFILL = "backfill"
    PRIORITY = "priority"
    FAIRSHARE = "fairshare"

    @classmethod
    def parse(cls, value: Policy | str) -> Policy:
        """Raises:
        SpecError: not one of the policies."""
        try:
            return cls(value)
        except ValueError:
            raise SpecError("policy", value, f"choose one of {', '.join(p.value for p in cls)}") from None


@dataclass(frozen=True, kw_only=True)
class Node:
    """One machine of the pool."""

    chips: int
    """Accelerators on this node."""
    labels: Mapping[str, str] = field(default_factory=dict)
    """Free-form labels; ``rack`` is used by packing (a gang prefers one rack)."""

    def __post_init__(self) -> None:
        if not isinstance(self.chips, int) or self.chips < 1:
            raise SpecError("chips", self.chips, "a node has a whole number of chips, at least 1")

    @property
    def rack(self) -> str | None:
        return self.labels.get("rack")


@dataclass(frozen=True, kw_only=True)
class Pool:
    """The nodes a scheduler places requests on; a node is known by its index."""

    nodes: tuple[Node, ...]
    """The pool's nodes, by index."""

    def __post_init__(self) -> None:
        if not self.nodes:
            raise SpecError("nodes", self.nodes, "a pool needs at least one node")

    @classmethod
    def uniform(cls, count: int, *, chips: int = 8, racks: int | None = None) -> Pool:
        """``count`` nodes of ``chips`` chips; with ``racks``, nodes are split into that many
        racks of consecutive indices (``rack-0`` holds the first ones)."""
        if not isinstance(count, int) or count < 1:
            raise SpecError("capacity", count, "give the pool's size in nodes, at least 1")
        per = math.ceil(count / racks) if racks else 0
        return cls(
            nodes=tuple(Node(chips=chips, labels={"rack": f"rack-{i // per}"} if racks else {}) for i in range(count))
        )

    @cached_property
    def total_chips(self) -> int:
        return sum(n.chips for n in self.nodes)

    @cached_property
    def max_chips(self) -> int:
        return max(n.chips for n in self.nodes)

    @cached_property
    def racks(self) -> tuple[str | None, ...] | None:
        """Each node's rack, or None when no node has one (packing then ignores racks)."""
        racks = tuple(n.rack for n in self.nodes)
        return racks if any(r is not None for r in racks) else None

    @cached_property
    def _capable(self) -> dict[int, tuple[int, ...]]:
        return {c: tuple(i for i, n in enumerate(self.nodes) if n.chips >= c) for c in range(1, self.max_chips + 1)}

    def capable(self, chips: int) -> tuple[int, ...]:
        """Indices of the nodes with at least ``chips`` chips."""
        return self._capable.get(chips, ()) if chips >= 1 else tuple(range(len(self.nodes)))

    def check(self, request: Request) -> None:
        """Refuse a request that could never start here, even on an idle pool.

        Raises:
            SpecError: naming ``chips_per_node`` or ``nodes``, the value and what fits.
        """
        c = request.chips_per_node
        if c > self.max_chips:
            raise SpecError(
                "chips_per_node",
                c,
                f"request {request.id!r}: the largest node has "
                f"{self.max_chips} chips; ask for at most {self.max_chips} per node "
                f"(and more nodes)",
            )
        able = len(self.capable(c))
        if request.nodes > able:
            raise SpecError(
                "nodes",
                request.nodes,
                f"request {request.id!r}: the pool has {able} nodes "
                f"with {c} chips or more ({self.total_chips} chips in all); ask for at most "
                f"{able} nodes of {c} chips",
            )


@dataclass(frozen=True, kw_only=True)
class Request:
    """A gang: ``nodes`` × ``chips_per_node`` chips, started all together or not at all."""

    id: str
    """Unique among the requests a scheduler sees."""
    chips_per_node: int
    """Chips on each node; less than a node's chips lets others share the node."""
    nodes: int = 1
    """Distinct nodes of the gang (never split further, never started partly)."""
    tenant: str = "default"
    """Who pays: fair share counts chips per tenant."""
    priority: int = 0
    """Higher goes first under ``priority`` (and may preempt lower)."""
    submitted: float = 0.0
    """When it was first submitted (kept when a preempted request goes back to the queue)."""
    estimate: float | None = None
    """Expected seconds of run time left; backfill never jumps a request without one."""
    preemptible: bool = True
    """Whether ``priority`` and ``fairshare`` may stop it once it runs (a run that cannot
    checkpoint and requeue says False and keeps its chips until it ends)."""

    def __post_init__(self) -> None:
        if not isinstance(self.id, str) or not self.id:
            raise SpecError("id", self.id, "give the request a non-empty string id")
        for name in ("nodes", "chips_per_node"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise SpecError(name, value, f"request {self.id!r}: a whole number, at least 1")
        if not isinstance(self.priority, int):
            raise SpecError("priority", self.priority, f"request {self.id!r}: a whole number (higher first)")
        if not math.isfinite(self.submitted):
            raise SpecError("submitted", self.submitted, f"request {self.id!r}: a finite time in seconds")
        if self.estimate is not None and not (math.isfinite(self.estimate) and self.estimate > 0):
            raise SpecError("estimate", self.estimate, f"request {self.id!r}: seconds > 0, or None if unknown")

    @property
    def chips(self) -> int:
        return self.nodes * self.chips_per_node

    def shape(self) -> str:
        """``2 nodes × 8 chips`` (for reasons)."""
        return f"{self.nodes} node{'s' if self.nodes > 1 else ''} × {self.chips_per_node} chips"


@dataclass(frozen=True, kw_only=True)
class Running:
    """A request holding chips: ``chips_per_node`` on each node of ``placement``."""

    request: Request
    placement: tuple[int, ...]
    """Node indices, one per gang member, distinct."""
    started: float
    """When it (last) started; with the request's estimate, when it is expected to end."""

    @property
    def end(self) -> float:
        """Expected end: ``started + estimate``, or infinity when there is no estimate."""
        est = self.request.estimate
        return math.inf if est is None else self.started + est


@dataclass(frozen=True)
class Start:
    """Start ``request`` now on ``placement`` (after the preemptions listed in ``after``)."""

    request: Request
    placement: tuple[int, ...]
    after: tuple[str, ...] = ()
    """Ids of the running requests this decision preempts to make room for this one."""


@dataclass(frozen=True)
class Preempt:
    """Stop ``running`` and give its request back to the queue (the caller resumes it later)."""

    running: Running
    reason: str


@dataclass(frozen=True)
class Waiting:
    """A request that stays queued: its place in the policy's order and why it waits."""

    request: Request
    position: int
    """0 is the next to be considered."""
    reason: str


class Explainer(Protocol):
    """The state a decision left, able to list the queue and say why each request waits."""

    def order(self) -> tuple[Request, ...]: ...

    def reason(self, position: int, request: Request) -> str: ...

    def reservation_at(self) -> float | None: ...


@dataclass(frozen=True, eq=False)
class Decision:
    """What to do now. Apply ``preempt`` first, then ``start``; everything else waits.

    ``queue`` and ``waiting`` (the position and reason of every request left waiting) are
    worked out on first access, so a caller that does not read them (the simulator) does not
    pay for them.
    """

    policy: Policy
    now: float
    start: tuple[Start, ...]
    preempt: tuple[Preempt, ...]
    context: Explainer | None = field(default=None, repr=False)

    @cached_property
    def reservation(self) -> float | None:
        """``backfill``: when the first blocked request is reserved to start (None: none)."""
        return self.context.reservation_at() if self.context else None

    @cached_property
    def queue(self) -> tuple[Request, ...]:
        """Requests still waiting after this decision, in the order the policy considers them."""
        return self.context.order() if self.context else ()

    @cached_property
    def waiting(self) -> tuple[Waiting, ...]:
        return tuple(Waiting(r, i, self.context.reason(i, r)) for i, r in enumerate(self.queue))

    def summary(self) -> str:
        """One line with the numbers behind the decision (for logs)."""
        head = f"; next: {self.queue[0].id} ({self.context.reason(0, self.queue[0])})" if self.queue else ""
        return (
            f"{self.policy.value} at t={self.now:g}: start {len(self.start)}, preempt "
            f"{len(self.preempt)}, waiting {len(self.queue)}{head}"
        )
