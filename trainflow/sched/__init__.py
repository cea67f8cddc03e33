"""Pure gang scheduling: policies, packing, a trace simulator (no Airflow, no I/O in the core).

``decide`` is the one decision the simulator and the allocator share; see ``policy``.
"""

from __future__ import annotations

from trainflow.sched.model import Decision, Node, Policy, Pool, Preempt, Request, Running, Start, Waiting
from trainflow.sched.policy import decide
from trainflow.sched.state import Occupancy, Queue

__all__ = [
    "Decision",
    "Node",
    "Occupancy",
    "Policy",
    "Pool",
    "Preempt",
    "Queue",
    "Request",
    "Running",
    "Start",
    "Waiting",
    "decide",
]
