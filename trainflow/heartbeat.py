"""Training-progress heartbeats and the pure decision on them.

Each rank writes ``heartbeats/rank-<r>.json`` (atomically) with its step, loss and
state; ``classify`` turns the set of heartbeats into a verdict with the numbers behind
it. Progress, not process liveness, is what counts: a rank whose step has not advanced
for ``heartbeat_timeout`` seconds is stalled even if its process is alive.
"""

from __future__ import annotations

import enum
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from trainflow.workspace import write_json_atomic


class RankState(str, enum.Enum):
    STARTING = "starting"
    TRAINING = "training"
    CHECKPOINTING = "checkpointing"
    DONE = "done"
    FAILED = "failed"


class Verdict(str, enum.Enum):
    """State machine of a run seen through its heartbeats.

    WAITING → HEALTHY → COMPLETE; from WAITING or HEALTHY a run may go to STALLED
    (a rank stopped progressing) or STARTUP_TIMEOUT (a rank never reported).
    """

    WAITING = "waiting"
    HEALTHY = "healthy"
    COMPLETE = "complete"
    STALLED = "stalled"
    STARTUP_TIMEOUT = "startup_timeout"


@dataclass(frozen=True)
class HeartbeatPolicy:
    """How long a rank may go without progress: ``timeout`` while it steps,
    ``startup_timeout`` while it starts (and before the watch saw it progress), and
    ``checkpoint_timeout`` (at least ``timeout``) while its heartbeat's phase is a save or an
    evaluation, and ``stall_timeout`` for a rank of a program without the SDK (its node
    agent beats for it: progress is the program's output and checkpoints)."""

    timeout: float
    startup_timeout: float
    checkpoint_timeout: float | None = None
    stall_timeout: float | None = None


# Heartbeat phases (``sdk.phase``, the built-in loop's own) and which limit applies in them.
STARTUP_PHASES = frozenset({"starting", "startup", "init"})
SAVE_PHASES = frozenset({"checkpoint", "checkpointing", "save", "eval", "evaluate", "evaluation"})


@dataclass(frozen=True)
class Classification:
    verdict: Verdict
    message: str
    ranks: tuple[int, ...] = ()
    steps: dict[int, int] = field(default_factory=dict)

    @property
    def terminal(self) -> bool:
        return self.verdict in (Verdict.COMPLETE, Verdict.STALLED, Verdict.STARTUP_TIMEOUT)


class HeartbeatWriter:
    """Writes one rank's heartbeat, at most once per ``interval`` unless the state changes.

    Two signals travel in each heartbeat: *progress* (``step``, ``progress_time``: when the
    step last advanced), written by the training loop, and *liveness* (``alive``, with the
    loop's current ``phase``), refreshed by a pulse thread (``start_pulse``) even while the
    loop is blocked. In a hang every rank stops progressing, but only the culprit also stops
    pulsing (SIGSTOP, a dead process) or sits outside the collective its peers wait in; that
    is how ``culprits`` tells it from its victims.
    """

    def __init__(self, directory: Path, *, rank: int, node: int, interval: float, world: int | None = None) -> None:
        import threading

        self.path = Path(directory) / f"rank-{rank:05d}.json"
        self.rank, self.node, self.interval, self.world = rank, node, interval, world
        self._started = time.time()
        self._last_write = 0.0
        self._last_state: RankState | None = None
        self._progress_at = time.time()
        self._step = -1
        self._muted_until = 0.0
        self._record: dict | None = None
        self._phase, self._phase_since = "starting", time.time()
        self._lock = threading.Lock()

    def mute(self, *, until: float) -> None:
        """Withhold heartbeats until ``until`` (the delay_heartbeats fault); DONE still goes out."""
        self._muted_until = until

    def set_phase(self, phase: str) -> None:
        """Where the training loop is (``forward``, ``backward`` — the collectives —, ...)."""
        if phase != self._phase:
            self._phase, self._phase_since = phase, time.time()

    def _write(self, record: dict, now: float) -> None:
        with self._lock:
            write_json_atomic(
                self.path, {**record, "alive": now, "phase": self._phase, "phase_since": self._phase_since}
            )

    def beat(self, *, step: int, total: int, state: RankState, force: bool = False, **extra) -> None:
        now = time.time()
        if step != self._step:
            self._step, self._progress_at = step, now
        if now < self._muted_until and state != RankState.DONE:  # the last word always goes out
            return
        if not force and state == self._last_state and now - self._last_write < self.interval:
            return
        self._record = {
            "rank": self.rank,
            "node": self.node,
            "pid": os.getpid(),
            "step": step,
            **({"world": self.world, "started": self._started} if self.world is not None else {}),
            "total": total,
            "state": state.value,
            "time": now,
            "progress_time": self._progress_at,
            **extra,
        }
        self._write(self._record, now)
        self._last_write, self._last_state = now, state

    def start_pulse(self) -> None:
        """Refresh ``alive`` every ``interval`` from a daemon thread, whatever the loop does."""
        import threading

        def loop() -> None:
            while True:
                time.sleep(self.interval)
                now = time.time()
                if self._record is not None and now >= self._muted_until:
                    self._write(self._record, now)

        threading.Thread(target=loop, name="heartbeat-pulse", daemon=True).start()


def read_all(directory: Path) -> dict[int, dict]:
    """All ranks' latest heartbeats; unreadable files are skipped (a writer may race)."""
    out: dict[int, dict] = {}
    d = Path(directory)
    if not d.is_dir():
        return out
    for p in d.glob("rank-*.json"):
        try:
            beat = json.loads(p.read_text())
            out[int(beat["rank"])] = beat
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return out


def node_starts(run_dir: Path) -> dict[int, float]:
    """node → when its ranks last started over: the newest of its agent's start
    (``nodes/node-<n>.json``: ``started``), that agent's last worker restart (``restarted``:
    a failure, or a new round to admit a node), and the start and end of its task's latest
    try (``nodes/task-<n>.json``: ``began``, before the preflight and the agent;
    ``ended_at``, after which Airflow retries it). Unreadable records are skipped."""
    out: dict[int, float] = {}
    d = Path(run_dir) / "nodes"
    if not d.is_dir():
        return out
    for p in (*d.glob("node-*.json"), *d.glob("task-*.json")):
        try:
            record = json.loads(p.read_text())
            node = int(record["node"]) if "node" in record else int(p.stem.rpartition("-")[2])
            times = [
                float(record[k]) for k in ("started", "restarted", "began", "ended_at") if record.get(k) is not None
            ]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if times:
            out[node] = max(out.get(node, 0.0), *times)
    return out


def current_gang(beats: dict[int, dict], world_size: int) -> tuple[dict[int, dict], int]:
    """The heartbeats of the gang now running, and its world size. Pure.

    An elastic gang changes size: the newest worker to start (``started``) tells the
    current world size; ranks beyond it are left over from a larger gang and ignored, and
    a rank whose beat still names another world size has not restarted into this gang yet
    (it counts as missing). Beats without ``world`` (older workers) belong to a gang of
    ``world_size``.
    """
    sized = [b for b in beats.values() if "world" in b]
    if not sized:
        return beats, world_size
    world = int(max(sized, key=lambda b: float(b.get("started", 0)))["world"])
    return {r: b for r, b in beats.items() if r < world and int(b.get("world", world)) == world}, world


def classify(
    beats: dict[int, dict],
    *,
    now: float,
    world_size: int,
    started_at: float,
    policy: HeartbeatPolicy,
    node_started: dict[int, float] | None = None,
) -> Classification:
    """Decide what the heartbeats of a run say. Pure: time is a parameter.

    Args:
        beats: rank → latest heartbeat (``read_all``).
        now: the current wall-clock time.
        world_size: ranks of the full gang (an elastic gang runs with what its beats
            say, ``current_gang``).
        started_at: when watching began (start of the startup window).
        policy: the timeouts.
        node_started: node → when its current agent started (``node_starts``). A rank
            whose last progress predates its node's restart is being replaced (Airflow
            retried the node's task, whose new workers have not beaten yet): the startup
            window applies to it from the node's start, not the progress timeout.
    """
    beats, world_size = current_gang(beats, world_size)
    steps = {r: int(b.get("step", -1)) for r, b in beats.items()}
    missing = sorted(set(range(world_size)) - set(beats))
    if missing:
        waited = now - started_at
        if waited > policy.startup_timeout:
            return Classification(
                Verdict.STARTUP_TIMEOUT,
                f"ranks {missing} sent no heartbeat in {waited:.1f}s (startup timeout {policy.startup_timeout}s)",
                tuple(missing),
                steps,
            )
        return Classification(Verdict.WAITING, f"waiting for ranks {missing}", tuple(missing), steps)
    if all(b.get("state") == RankState.DONE.value for b in beats.values()):
        return Classification(Verdict.COMPLETE, f"all {world_size} ranks done", (), steps)
    stalled = []
    for r, b in sorted(beats.items()):
        state = b.get("state")
        if state == RankState.DONE.value:
            continue
        progress = float(b.get("progress_time", b.get("time", 0)))
        restarted = (node_started or {}).get(int(b["node"])) if b.get("node") is not None else None
        if restarted is not None and restarted <= progress:
            restarted = None
        if (
            state in (RankState.STARTING.value, RankState.FAILED.value)
            or progress < started_at
            or restarted is not None
        ):
            # Starting up (imports, rendezvous), not seen progressing since the watch
            # (re)started, or its node's task restarted since (a replacement starting
            # cold): the startup window applies, not the progress timeout.
            since, limit = max(progress, started_at, restarted or 0.0), policy.startup_timeout
        elif b.get("phase") in STARTUP_PHASES and b.get("phase") != "starting":
            # A program's own start-up section (sdk.phase("startup")): the startup window.
            since = max(progress, float(b.get("phase_since") or progress))
            limit = policy.startup_timeout
        elif b.get("source") == "agent":
            # A program without the SDK: silent (no output, no new checkpoint) this long.
            since, limit = progress, policy.stall_timeout or policy.timeout
        elif state == RankState.CHECKPOINTING.value or b.get("phase") in SAVE_PHASES:
            since, limit = progress, max(policy.timeout, policy.checkpoint_timeout or policy.timeout)
        else:
            since, limit = progress, policy.timeout
        if now - since > limit:
            stalled.append((r, now - since))
    if stalled:
        desc = ", ".join(f"rank {r} without progress for {age:.1f}s at step {steps[r]}" for r, age in stalled)
        ranks, why = culprits(beats, [r for r, _ in stalled], now=now, timeout=policy.timeout)
        return Classification(
            Verdict.STALLED, f"{desc} (timeout {policy.timeout}s); culprits {list(ranks)}: {why}", tuple(ranks), steps
        )
    return Classification(
        Verdict.HEALTHY,
        f"{world_size} ranks progressing, steps {min(steps.values())}..{max(steps.values())}",
        (),
        steps,
    )


def culprits(beats: dict[int, dict], stalled: list[int], *, now: float, timeout: float) -> tuple[list[int], str]:
    """Which of the ``stalled`` ranks hold the gang up. Pure.

    In a synchronous gang one stuck rank stalls every rank; replacing only the culprit's
    node keeps the others' nodes (and their hosts' records) out of it. In order:

    1. ranks whose liveness pulse stopped too (a stopped or dead process), if not all
       (if all stopped: every rank);
    2. ranks outside ``backward`` (where DDP/FSDP collectives run) while others wait in it;
    3. otherwise every stalled rank (it cannot be told).
    """
    # A live process pulses every heartbeat interval, far inside ``timeout / 2``. A stopped
    # one's last pulse can be up to one interval newer than its last progress write, so when
    # the progress timeout fires its pulse may be just under ``timeout`` old: half is the mark.
    silent = [r for r in stalled if "alive" in beats[r] and now - float(beats[r]["alive"]) > timeout / 2]
    if silent and len(silent) < len(stalled):
        return silent, "their processes stopped (no liveness pulse) while their peers wait"
    if silent:
        return list(stalled), "every stalled rank stopped pulsing"
    waiting = [r for r in stalled if beats[r].get("phase") == "backward"]
    stuck = [r for r in stalled if r not in waiting and beats[r].get("phase") not in (None, "starting")]
    if waiting and stuck:
        return stuck, "stuck outside the collective their peers wait in"
    return list(stalled), "cannot tell the culprit apart: every stalled rank"


def find_stragglers(beats: dict[int, dict], *, margin: float) -> list[dict]:
    """Ranks whose compute time per step exceeds the median of the others by ``margin``.

    In synchronous training every rank advances at the slowest rank's pace, so step rates
    cannot show a straggler; each rank's own compute time (forward, before it waits in
    the gradient all-reduce) can. Pure.

    Returns:
        ``[{"rank", "node", "compute_ms", "median_ms", "slower_by"}]`` for each straggler.
    """
    times = {
        r: float(b["compute_ms"])
        for r, b in beats.items()
        if b.get("state") == RankState.TRAINING.value and b.get("compute_ms")
    }
    out = []
    for r, t in sorted(times.items()):
        others = sorted(v for k, v in times.items() if k != r)
        if not others:
            continue
        mid = len(others) // 2
        median = others[mid] if len(others) % 2 else (others[mid - 1] + others[mid]) / 2
        if median > 0 and t > (1 + margin) * median:
            out.append(
                {
                    "rank": r,
                    "node": beats[r].get("node"),
                    "compute_ms": round(t, 3),
                    "median_ms": round(median, 3),
                    "slower_by": round(t / median - 1, 3),
                }
            )
    return out


class Action(str, enum.Enum):
    """What the heartbeat watch does about a verdict."""

    WAIT = "wait"
    SUCCEED = "succeed"
    REPLACE_NODES = "replace_nodes"
    FAIL = "fail"


def decide(verdict: Verdict, *, replacements: int, budget: int, aborted: bool = False) -> Action:
    """Pure decision on a classification: time-free, so trivially testable.

    The watch's invariant (with ``classify``): a run none of whose ranks made progress for
    longer than ``heartbeat_timeout``, ``startup_timeout`` and ``checkpoint_timeout`` — counted from the
    watch's start and each node's latest restart, so a restart under way moves the moment,
    never removes it — is never left waiting: its stalled nodes are replaced, or, with the
    replacement budget spent or the run aborted, it fails. A property test holds this over
    arbitrary heartbeats.

    Args:
        verdict: the current classification.
        replacements: node replacements already requested for this run.
        budget: the most replacements the run may use (retries × nodes).
        aborted: the run was stopped for a non-retryable reason.
    """
    if aborted:
        return Action.FAIL
    if verdict == Verdict.COMPLETE:
        return Action.SUCCEED
    if verdict in (Verdict.STALLED, Verdict.STARTUP_TIMEOUT):
        return Action.REPLACE_NODES if replacements < budget else Action.FAIL
    return Action.WAIT
