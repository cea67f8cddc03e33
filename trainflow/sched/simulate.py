"""Replay a job trace on a virtual clock through ``decide`` and measure the schedule.

Event-driven: the clock jumps from event to event (a submission, a finish); after applying
every event of an instant, ``decide`` runs once on the incrementally kept ``Queue`` and
``Occupancy`` and its decision is applied (preemptions, then starts; if it preempted, it
runs again at the same instant so the requeued requests may go elsewhere). A preempted job
keeps the work up to its last checkpoint (every ``checkpoint_interval`` seconds of its own
progress; none without one), loses the rest, and goes back to the queue at its original
place with its estimate reduced by the work it kept.

Metrics (``Report``), over the span from the first submission to the last finish:

- utilization: allocated chips / total chips, time-weighted (chips a gang rounds up to
  whole nodes count as allocated);
- saturated utilization: the same over the saturated time only, the instants at which,
  after the decision, at least one request is still waiting; ``saturated_fraction`` is
  that time over the span;
- JCT (job completion time) = finish − first submission; mean, p50 and p95 (nearest
  rank: the ⌈p·n⌉-th smallest);
- queueing delay: the time a job spent waiting, summed over its waits (after a preemption
  it waits again);
- tenant share: each tenant's chip-seconds / all allocated chip-seconds;
- preemptions, and the chip-seconds of work they threw away.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from trainflow.errors import SpecError
from trainflow.sched.model import Policy, Pool, Running
from trainflow.sched.policy import DEFAULT_BACKFILL_WINDOW, decide
from trainflow.sched.state import Occupancy, Queue
from trainflow.sched.trace import TraceJob

_FINISH, _SUBMIT = 0, 1  # at one instant, finishes free chips before submissions are seen
_MAX_ROUNDS = 1000  # decisions at one instant; preemption cannot cycle (see policy), so never reached


@dataclass(frozen=True, kw_only=True)
class Report:
    """What a simulated schedule achieved (see the module docstring for the definitions)."""

    policy: str
    jobs: int
    nodes: int
    chips: int
    """Chips in the pool."""
    span_s: float
    utilization: float
    saturated_utilization: float | None
    """None when the queue was never non-empty."""
    saturated_fraction: float
    jct_mean_s: float
    jct_p50_s: float
    jct_p95_s: float
    queue_delay_mean_s: float
    tenant_share: dict[str, float]
    tenant_queue_delay_s: dict[str, float]
    """Mean queueing delay of each tenant's jobs."""
    queue_max: int
    """The most requests waiting at once."""
    preemptions: int
    lost_chip_s: float
    decisions: int
    start_s: float
    """Clock of the first submission (the series' times are on the trace's clock)."""
    series: tuple[tuple[float, float, float], ...]
    """(bin start, utilization, mean queue length) per equal time bin, time-weighted."""

    def to_dict(self, *, series: bool = True) -> dict:
        out = asdict(self)
        if not series:
            del out["series"]
        return out


def percentile(values: Sequence[float], p: float) -> float:
    """Nearest rank: the ⌈p/100·n⌉-th smallest value."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(p / 100 * len(ordered)) - 1)]


def simulate(
    jobs: Sequence[TraceJob],
    *,
    pool: Pool,
    policy: Policy | str,
    checkpoint_interval: float | None = None,
    quotas: Mapping[str, int] | None = None,
    backfill_window: int = DEFAULT_BACKFILL_WINDOW,
    bins: int = 500,
) -> Report:
    """Run ``jobs`` to completion on ``pool`` under ``policy``.

    Args:
        jobs: the trace; request ids must be unique.
        pool: the nodes.
        policy: passed to ``decide``.
        checkpoint_interval: seconds of progress between a job's checkpoints (None: a
            preempted job starts over).
        quotas: ``fairshare`` quotas in chips; None: the pool split evenly among the
            trace's tenants, for the whole run.
        backfill_window: passed to ``decide``.
        bins: points of the utilization series.

    Raises:
        SpecError: an empty trace, a job that could never fit the pool, bad arguments.
    """
    policy = Policy.parse(policy)
    if not jobs:
        raise SpecError("jobs", 0, "give at least one job")
    if checkpoint_interval is not None and not checkpoint_interval > 0:
        raise SpecError("checkpoint_interval", checkpoint_interval, "seconds > 0, or None for no checkpoints")
    if policy == Policy.FAIRSHARE and quotas is None:
        from trainflow.sched.policy import equal_shares

        quotas = equal_shares(pool, [j.request.tenant for j in jobs])
    reqs = [j.request for j in jobs]
    for r in reqs:
        pool.check(r)
    index = {r.id: i for i, r in enumerate(reqs)}
    if len(index) != len(reqs):
        raise SpecError("jobs", len(reqs) - len(index), "duplicate request ids; ids must be unique")
    n = len(jobs)
    done = [0.0] * n  # work kept (checkpointed) so far
    epoch = [0] * n  # bumped on preemption: that run's finish event is stale
    enqueued = [0.0] * n
    waited = [0.0] * n
    finished = [math.nan] * n
    queue, occ = Queue(pool), Occupancy(pool)
    events = [(r.submitted, _SUBMIT, i, i, 0) for i, r in enumerate(reqs)]
    heapq.heapify(events)
    seq = n
    total = pool.total_chips
    points: list[tuple[float, int, int]] = []  # (time, allocated chips, queue length) from then on
    tenant_cs: dict[str, float] = {}
    usage: dict[str, int] = {}
    chip_s = sat_s = sat_chip_s = lost_chip_s = 0.0
    preemptions = decisions = 0
    t_prev = events[0][0]
    alloc = qlen = 0
    while events:
        t = events[0][0]
        dt = t - t_prev
        if dt > 0:
            chip_s += alloc * dt
            if qlen:
                sat_s += dt
                sat_chip_s += alloc * dt
            for tenant, used in usage.items():
                tenant_cs[tenant] = tenant_cs.get(tenant, 0.0) + used * dt
        while events and events[0][0] == t:
            _, kind, _, i, ep = heapq.heappop(events)
            if kind == _SUBMIT:
                queue.add(reqs[i])
                enqueued[i] = t
            elif ep == epoch[i]:
                occ.remove(reqs[i].id)
                finished[i] = t
        for _ in range(_MAX_ROUNDS):
            d = decide(
                policy, pool=pool, running=occ, waiting=queue, now=t, quotas=quotas, backfill_window=backfill_window
            )
            decisions += 1
            for p in d.preempt:
                rid = p.running.request.id
                i = index[rid]
                run = occ.remove(rid)
                progress = done[i] + (t - run.started)
                kept = done[i]
                if checkpoint_interval:
                    kept = max(kept, math.floor(progress / checkpoint_interval) * checkpoint_interval)
                lost_chip_s += (progress - kept) * run.request.chips
                done[i] = kept
                epoch[i] += 1
                preemptions += 1
                est = reqs[i].estimate
                left = None if est is None else max(est - kept, 1.0)
                queue.add(replace(run.request, estimate=left))
                enqueued[i] = t
            for s in d.start:
                rid = s.request.id
                i = index[rid]
                queue.remove(rid)
                occ.add(Running(request=s.request, placement=s.placement, started=t))
                waited[i] += t - enqueued[i]
                seq += 1
                heapq.heappush(events, (t + jobs[i].duration - done[i], _FINISH, seq, i, epoch[i]))
            if not d.preempt:
                break
        else:
            raise AssertionError(f"decide kept preempting at t={t}")
        alloc, qlen = total - occ.free.total, len(queue)
        usage = dict(occ.usage)
        points.append((t, alloc, qlen))
        t_prev = t
    assert not queue and not occ, "every job ends"
    start = min(r.submitted for r in reqs)
    span = t_prev - start
    jct = [finished[i] - reqs[i].submitted for i in range(n)]
    return Report(
        policy=policy.value,
        jobs=n,
        nodes=len(pool.nodes),
        chips=total,
        span_s=span,
        utilization=chip_s / (total * span) if span else 0.0,
        saturated_utilization=sat_chip_s / (total * sat_s) if sat_s else None,
        saturated_fraction=sat_s / span if span else 0.0,
        jct_mean_s=sum(jct) / n,
        jct_p50_s=percentile(jct, 50),
        jct_p95_s=percentile(jct, 95),
        queue_delay_mean_s=sum(waited) / n,
        tenant_share={t: cs / chip_s for t, cs in sorted(tenant_cs.items())} if chip_s else {},
        tenant_queue_delay_s=_mean_by(reqs, waited),
        queue_max=max(q for _, _, q in points),
        preemptions=preemptions,
        lost_chip_s=lost_chip_s,
        decisions=decisions,
        start_s=start,
        series=_bin(points, start, t_prev, total, bins),
    )


def _mean_by(reqs: Sequence, values: Sequence[float]) -> dict[str, float]:
    sums: dict[str, list[float]] = {}
    for r, v in zip(reqs, values):
        sums.setdefault(r.tenant, []).append(v)
    return {t: sum(vs) / len(vs) for t, vs in sorted(sums.items())}


def _bin(
    points: list[tuple[float, int, int]], start: float, end: float, total: int, bins: int
) -> tuple[tuple[float, float, float], ...]:
    """Time-weighted means of the step functions in ``points`` over ``bins`` equal bins."""
    if end <= start or bins < 1:
        return ()
    width = (end - start) / bins
    chips = [0.0] * bins
    queued = [0.0] * bins
    for (t, alloc, qlen), nxt in zip(points, points[1:]):
        a, b = t, nxt[0]
        k = min(int((a - start) / width), bins - 1)
        while a < b:
            edge = b if k >= bins - 1 else min(b, start + (k + 1) * width)
            if edge > a:  # (rounding may put a on the bin's far edge: then the next bin)
                chips[k] += alloc * (edge - a)
                queued[k] += qlen * (edge - a)
                a = edge
            k += 1
    return tuple((start + k * width, chips[k] / (total * width), queued[k] / width) for k in range(bins))


def format_report(report: Report) -> str:
    """The report as a few human lines."""
    sat = (
        "n/a (the queue was never non-empty)"
        if report.saturated_utilization is None
        else f"{report.saturated_utilization:.1%}"
    )
    share = ", ".join(
        f"{t} {s:.1%} ({report.tenant_queue_delay_s.get(t, 0) / 3600:.1f} h)" for t, s in report.tenant_share.items()
    )
    return "\n".join(
        [
            f"policy {report.policy}: {report.jobs} jobs on {report.nodes} nodes ({report.chips} chips) "
            f"over {report.span_s / 86400:.2f} days, {report.decisions} decisions",
            f"utilization {report.utilization:.1%} overall, {sat} while saturated "
            f"(queue non-empty {report.saturated_fraction:.1%} of the time)",
            f"JCT mean {report.jct_mean_s / 3600:.2f} h, p50 {report.jct_p50_s / 3600:.2f} h, "
            f"p95 {report.jct_p95_s / 3600:.2f} h; mean queueing delay {report.queue_delay_mean_s / 3600:.2f} h, "
            f"at most {report.queue_max} waiting",
            f"preemptions {report.preemptions} ({report.lost_chip_s / 3600:.1f} chip-hours of work lost)",
            f"tenant share of chip-time (mean queueing delay): {share}",
        ]
    )


def plot(reports: Report | Sequence[Report], path: Path | str, *, title: str | None = None) -> Path:
    """Utilization (top) and mean queue length (bottom) over time, one line per report; PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    reports = [reports] if isinstance(reports, Report) else list(reports)
    fig, (ux, qx) = plt.subplots(2, 1, sharex=True, figsize=(10, 6), dpi=100, gridspec_kw={"height_ratios": [3, 2]})
    for rep in reports:
        days = [(t - rep.start_s) / 86400 for t, _, _ in rep.series]
        sat = "n/a" if rep.saturated_utilization is None else f"{rep.saturated_utilization:.1%}"
        ux.step(
            days,
            [100 * u for _, u, _ in rep.series],
            where="post",
            lw=1,
            label=f"{rep.policy}: {rep.utilization:.1%} overall, {sat} saturated, p95 JCT {rep.jct_p95_s / 3600:.1f} h",
        )
        qx.step(days, [q for _, _, q in rep.series], where="post", lw=1, label=rep.policy)
    ux.set_ylabel("allocated chips (%)")
    ux.set_ylim(0, 105)
    ux.legend(fontsize=8, loc="lower right")
    qx.set_ylabel("requests waiting")
    qx.set_xlabel("days since the first submission")
    qx.legend(fontsize=8)
    first = reports[0]
    ux.set_title(title or f"{first.jobs} jobs on {first.nodes} nodes × {first.chips // first.nodes} chips", fontsize=9)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    return out
