"""Which running requests to stop so a waiting one fits (priority and quota reclaim)."""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

from trainflow.sched.capacity import FreeMap
from trainflow.sched.model import Pool, Request, Running


def victims(
    pool: Pool,
    free: FreeMap,
    on_node: Sequence[Sequence[Running]],
    request: Request,
    eligible: Callable[[Running], bool],
    gone: Collection[str],
) -> tuple[Running, ...] | None:
    """The fewest running requests whose chips, with the free ones, fit ``request``; None if
    the eligible ones cannot free enough.

    Per node: no victim if the node already has the chips free; else the single eligible
    run that frees enough, the most recently started one (it loses the least work); else
    the biggest ones first. Then the ``request.nodes`` cheapest nodes: fewest victims, then
    the youngest oldest victim, then the lower index. Runs in ``gone`` are already preempted;
    runs whose request is not ``preemptible`` are never victims.
    """
    c = request.chips_per_node
    options: list[tuple[tuple, tuple[Running, ...]]] = []
    for x, node in enumerate(pool.nodes):
        if node.chips < c:
            continue
        need = c - free.free[x]
        if need <= 0:
            options.append(((0, 0.0, x), ()))
            continue
        cands = [run for run in on_node[x] if run.request.id not in gone and run.request.preemptible and eligible(run)]
        chosen = _fewest(cands, need)
        if chosen is not None:
            options.append(((len(chosen), -min(run.started for run in chosen), x), chosen))
    if len(options) < request.nodes:
        return None
    options.sort(key=lambda o: o[0])
    picked: dict[str, Running] = {}
    for _, chosen in options[: request.nodes]:
        for run in chosen:
            picked[run.request.id] = run
    return tuple(picked.values())


def _fewest(cands: list[Running], need: int) -> tuple[Running, ...] | None:
    singles = [run for run in cands if run.request.chips_per_node >= need]
    if singles:
        return (max(singles, key=lambda run: (run.started, run.request.id)),)
    chosen: list[Running] = []
    for run in sorted(cands, key=lambda run: (-run.request.chips_per_node, -run.started, run.request.id)):
        chosen.append(run)
        need -= run.request.chips_per_node
        if need <= 0:
            return tuple(chosen)
    return None
