"""Fault injection as a feature: a fault schedule in the spec, fired by the workers.

It is how the tests and benchmarks inject faults and how users rehearse recovery. Each
fault fires when its rank reaches its step. Infrastructure faults fire once per run (a
marker file is created atomically before firing, so a resumed gang does not fire it
again); ``raise`` models a deterministic bug in user code and fires every time.
"""

from __future__ import annotations

import enum
import os
import signal
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping

from trainflow.errors import SpecError
from trainflow.timeline import record


class FaultKind(str, enum.Enum):
    KILL_RANK = "kill_rank"  # SIGKILL the rank's worker process (process fault)
    KILL_NODE = "kill_node"  # SIGKILL the node's shard_train task (or agent) and its tree
    LOSE_NODE = "lose_node"  # kill_node, and the node's host is gone for `seconds` (0: for good)
    STOP_RANK = "stop_rank"  # SIGSTOP the rank (a hang: alive but no progress)
    CORRUPT_CHECKPOINT = "corrupt_checkpoint"  # flip bytes in the newest checkpoint, then kill the rank
    RAISE = "raise"  # a deterministic user bug: ValueError in the workload
    CRASH_RANK = "crash_rank"  # SIGKILL the rank every time it reaches the step (crash loop)
    SLOW_RANK = "slow_rank"  # from the step on, the rank computes 4× slower (a straggler)
    FILL_DISK = "fill_disk"  # fill the checkpoint filesystem until the next save has failed
    DELAY_HEARTBEATS = "delay_heartbeats"  # the rank trains on but withholds heartbeats for `seconds`
    ALLOCATE = "allocate"  # the workload allocates memory without bound (needs memory_limit_mb)


ONCE = {
    FaultKind.KILL_RANK,
    FaultKind.KILL_NODE,
    FaultKind.LOSE_NODE,
    FaultKind.STOP_RANK,
    FaultKind.CORRUPT_CHECKPOINT,
    FaultKind.FILL_DISK,
    FaultKind.DELAY_HEARTBEATS,
}
# Bytes left free by fill_disk: less than any checkpoint, so the next save hits ENOSPC.
FILL_LEAVE_BYTES = 4096
# fill_disk refuses a filesystem with more free space than this (it is a rehearsal, not
# a way to exhaust a production volume): TRAINFLOW_FAULT_FILL_MAX_BYTES, default 4 GiB.
FILL_MAX_BYTES = 4 << 30
# The deployment setting that allows fault schedules in every training DAG of the
# deployment (a rehearsal environment); otherwise a DAG opts in with
# ``training_dag(..., allow_faults=True)``.
ALLOW_FAULTS_ENV = "TRAINFLOW_ALLOW_FAULTS"


def check_allowed(faults: tuple, *, dag_allows: bool, env: Mapping[str, str] | None = None) -> None:
    """Refuse a fault schedule that neither the DAG nor the deployment allows.

    Injecting faults is a privileged rehearsal, not a lever every user who may trigger a
    training DAG holds over shared capacity.

    Raises:
        SpecError: ``faults`` is not empty and neither allows it (naming both switches).
    """
    env = os.environ if env is None else env
    if not faults or dag_allows or env.get(ALLOW_FAULTS_ENV, "").lower() in ("1", "true", "yes"):
        return
    raise SpecError(
        "faults",
        [f.to_dict() if isinstance(f, Fault) else f for f in faults],
        "fault injection is a rehearsal this DAG does not allow: build it with "
        f"training_dag(..., allow_faults=True), or set {ALLOW_FAULTS_ENV}=1 in the "
        "deployment's environment; or leave faults empty",
    )


@dataclass(frozen=True, kw_only=True)
class Fault:
    """One scheduled fault: ``kind`` fires when ``rank`` reaches ``step``.

    ``seconds`` is the duration of a ``delay_heartbeats`` fault, and how long a
    ``lose_node`` fault's node stays gone (0: for good); unused by the others.
    """

    kind: FaultKind
    step: int
    rank: int = 0
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["kind"] = self.kind.value
        if not self.seconds:
            del d["seconds"]
        return d


FAULT_SCHEMA = {
    "type": "array",
    "maxItems": 32,
    "items": {
        "type": "object",
        "additionalProperties": False,
        "required": ["kind", "step"],
        "properties": {
            "kind": {"type": "string", "enum": [k.value for k in FaultKind]},
            "step": {"type": "integer", "minimum": 1},
            "rank": {"type": "integer", "minimum": 0},
            "seconds": {"type": "number", "minimum": 0, "maximum": 3600},
        },
    },
}


def parse_faults(value: Iterable[Any], *, world_size: int, steps: int) -> tuple[Fault, ...]:
    """Validate a fault schedule (list of mappings or ``Fault``s).

    Raises:
        SpecError: naming the offending entry and the fix.
    """
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise SpecError("faults", value, "must be a list of {kind, step, rank} objects")
    out = []
    for i, item in enumerate(value):
        if isinstance(item, Fault):
            item = item.to_dict()
        if not isinstance(item, Mapping):
            raise SpecError(f"faults[{i}]", item, "must be an object with kind, step and rank")
        unknown = set(item) - {"kind", "step", "rank", "seconds"}
        if unknown:
            raise SpecError(f"faults[{i}]", item, f"unknown keys {sorted(unknown)}; use kind, step, rank, seconds")
        try:
            kind = FaultKind(item.get("kind"))
        except ValueError:
            raise SpecError(
                f"faults[{i}].kind", item.get("kind"), f"use one of {', '.join(k.value for k in FaultKind)}"
            ) from None
        step, rank = item.get("step"), item.get("rank", 0)
        for name, v in (("step", step), ("rank", rank)):
            if isinstance(v, bool) or not isinstance(v, int):
                raise SpecError(f"faults[{i}].{name}", v, "must be an integer")
        if not 1 <= step <= steps:
            raise SpecError(f"faults[{i}].step", step, f"must be between 1 and steps ({steps})")
        if not 0 <= rank < world_size:
            raise SpecError(f"faults[{i}].rank", rank, f"must be a rank of the gang (0..{world_size - 1})")
        seconds = item.get("seconds", 0)
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 <= seconds <= 3600:
            raise SpecError(f"faults[{i}].seconds", seconds, "must be a number of seconds in 0..3600")
        if kind == FaultKind.DELAY_HEARTBEATS and not seconds:
            raise SpecError(
                f"faults[{i}].seconds",
                seconds,
                "delay_heartbeats needs seconds > 0: how long the heartbeats are withheld",
            )
        if kind not in (FaultKind.DELAY_HEARTBEATS, FaultKind.LOSE_NODE) and seconds:
            raise SpecError(
                f"faults[{i}].seconds",
                seconds,
                f"only delay_heartbeats and lose_node take seconds; drop it for {kind.value}",
            )
        out.append(Fault(kind=kind, step=step, rank=rank, seconds=float(seconds)))
    return tuple(out)


class FaultInjector:
    """Fires the faults of one rank (runs inside the worker).

    Args:
        faults: the run's schedule (only this rank's entries fire).
        run_dir: the run's workspace (markers, timeline, checkpoint filesystem).
        rank: this worker's global rank.
        heartbeat: this rank's ``HeartbeatWriter`` (``delay_heartbeats`` mutes it).
    """

    def __init__(self, faults: Iterable[Fault], *, run_dir: Path, rank: int, heartbeat=None) -> None:
        self.run_dir, self.rank, self.heartbeat = Path(run_dir), rank, heartbeat
        self.pending = [(i, f) for i, f in enumerate(faults) if f.rank == rank]
        self.slow = next(((i, f.step) for i, f in self.pending if f.kind == FaultKind.SLOW_RANK), None)
        self._slow_active: bool | None = None
        self._ballast: Path | None = None
        self._ballast_step = 0

    def _marker(self, index: int) -> Path:
        return self.run_dir / "faults" / f"fault-{index}.fired"

    def _claim(self, index: int, content: str = "") -> bool:
        """Create the fault's marker atomically; False if it already fired."""
        marker = self._marker(index)
        marker.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        try:
            os.write(fd, content.encode())
        finally:
            os.close(fd)
        return True

    def _announce(self, fault: Fault, step: int, **extra) -> None:
        print(f"[rank {self.rank}] FAULT INJECTED: {fault.kind.value} at step {step}", flush=True)
        record(self.run_dir, "fault_injected", kind=fault.kind.value, step=step, rank=self.rank, **extra)

    def slowdown(self, step: int, compute_s: float) -> None:
        """Stretch this step's compute time while a slow_rank fault is active.

        The slowness belongs to the node incarnation that first reached the step (its
        agent's pid is kept in the marker): a slow host stays slow across worker restarts,
        and a replacement node (a new agent, as after straggler exclusion) is healthy.
        """
        if self.slow is None or step < self.slow[1]:
            return
        if self._slow_active is None:
            index, at = self.slow
            agent = os.environ.get("TRAINFLOW_AGENT_PID", str(os.getppid()))
            if self._claim(index, agent):
                self._announce(Fault(kind=FaultKind.SLOW_RANK, step=at, rank=self.rank), step)
            self._slow_active = self._marker(index).read_text() == agent
        if self._slow_active:
            import time

            time.sleep(3 * compute_s + 0.002)

    def before_step(self, step: int) -> None:
        """Fire faults scheduled at ``step`` (called before the step trains)."""
        for index, fault in self.pending:
            if fault.step != step or fault.kind in (FaultKind.CORRUPT_CHECKPOINT, FaultKind.SLOW_RANK):
                continue
            if fault.kind == FaultKind.RAISE:
                raise ValueError(f"injected user bug at step {step} on rank {self.rank}")
            if fault.kind == FaultKind.ALLOCATE:
                record(self.run_dir, "fault_injected", kind=fault.kind.value, step=step, rank=self.rank)
                hoard = []
                while True:  # ends in MemoryError at the worker's memory limit (spec.memory_limit_mb)
                    hoard.append(bytearray(64 << 20))
            if fault.kind == FaultKind.CRASH_RANK:
                record(self.run_dir, "fault_injected", kind=fault.kind.value, step=step, rank=self.rank)
                os.kill(os.getpid(), signal.SIGKILL)
            if not self._claim(index):
                continue
            if fault.kind == FaultKind.FILL_DISK:
                self._fill_disk(fault, step)
                continue
            self._announce(fault, step, **({"seconds": fault.seconds} if fault.seconds else {}))
            if fault.kind == FaultKind.KILL_RANK:
                os.kill(os.getpid(), signal.SIGKILL)
            elif fault.kind == FaultKind.STOP_RANK:
                os.kill(os.getpid(), signal.SIGSTOP)
            elif fault.kind == FaultKind.DELAY_HEARTBEATS and self.heartbeat is not None:
                import time

                self.heartbeat.mute(until=time.time() + fault.seconds)
            elif fault.kind in (FaultKind.KILL_NODE, FaultKind.LOSE_NODE):
                from trainflow.cluster.nodes import mark_injected

                node = int(os.environ.get("TRAINFLOW_NODE", "-1"))
                mark_injected(self.run_dir, node, fault.kind.value)  # not charged to the host
                if fault.kind == FaultKind.LOSE_NODE:
                    from trainflow.cluster.slots import mark_lost

                    mark_lost(
                        self.run_dir,
                        node,
                        seconds=fault.seconds,
                        reason=f"lose_node fault at step {step} (rank {self.rank})",
                    )
                # The node task's process under Airflow, else the agent; the rest of the
                # tree follows through PDEATHSIG.
                target = int(os.environ.get("TRAINFLOW_NODE_TASK_PID") or os.environ.get("TRAINFLOW_AGENT_PID", "0"))
                if target:
                    os.kill(target, signal.SIGKILL)
                os.kill(os.getpid(), signal.SIGKILL)

    def _fill_disk(self, fault: Fault, step: int) -> None:
        """Allocate a ballast file that leaves the checkpoint filesystem nearly full.

        The space is really taken (``posix_fallocate``), so the next save fails with
        ENOSPC in the filesystem itself; ``save_finished`` frees it afterwards.
        """
        root = self.run_dir / "checkpoints"
        root.mkdir(parents=True, exist_ok=True)
        st = os.statvfs(root)
        free = (st.f_bfree if os.geteuid() == 0 else st.f_bavail) * st.f_frsize
        cap = int(os.environ.get("TRAINFLOW_FAULT_FILL_MAX_BYTES", FILL_MAX_BYTES))
        size = free - FILL_LEAVE_BYTES
        if size > cap:
            print(
                f"[rank {self.rank}] fill_disk skipped: {free} bytes free on the checkpoint "
                f"filesystem, more than TRAINFLOW_FAULT_FILL_MAX_BYTES={cap}",
                flush=True,
            )
            record(
                self.run_dir,
                "fault_skipped",
                kind=fault.kind.value,
                step=step,
                rank=self.rank,
                reason=f"{free} bytes free > cap {cap}",
            )
            return
        ballast = root / f".ballast-rank{self.rank}"
        fd = os.open(ballast, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            if size > 0:
                try:
                    os.posix_fallocate(fd, 0, size)
                except OSError:  # ENOSPC at the last blocks: the disk is as full as it gets
                    pass
        finally:
            os.close(fd)
        self._ballast, self._ballast_step = ballast, step
        self._announce(fault, step, ballast_bytes=ballast.stat().st_size, free_before=free)

    def ballast_outlived(self, last_save_step: int) -> bool:
        """True if a fill_disk ballast is held and a save begun after the fill has since
        finished (``last_save_step`` is that save's step)."""
        return self._ballast is not None and last_save_step >= self._ballast_step

    def save_finished(self, step: int, ok: bool) -> None:
        """A checkpoint save ended (either way): free the fill_disk ballast, if any."""
        if self._ballast is None:
            return
        size = self._ballast.stat().st_size if self._ballast.exists() else 0
        self._ballast.unlink(missing_ok=True)
        self._ballast = None
        print(
            f"[rank {self.rank}] fill_disk: save of step {step} {'succeeded' if ok else 'failed'}; "
            f"released {size} bytes",
            flush=True,
        )
        record(self.run_dir, "disk_released", step=step, rank=self.rank, save_ok=ok, bytes=size)

    def after_checkpoint(self, step: int, checkpoint_dir: Path | None) -> None:
        """Corrupt the checkpoint just committed at ``step`` (rank 0 holds its path)."""
        for index, fault in self.pending:
            if fault.kind != FaultKind.CORRUPT_CHECKPOINT or fault.step != step:
                continue
            if checkpoint_dir is None or not self._claim(index):
                continue
            victim = next(p for p in sorted(Path(checkpoint_dir).iterdir()) if p.suffix == ".distcp")
            data = bytearray(victim.read_bytes())
            data[len(data) // 2] ^= 0xFF
            victim.write_bytes(bytes(data))
            print(f"[rank {self.rank}] FAULT INJECTED: corrupted {victim} after step {step}", flush=True)
            record(self.run_dir, "fault_injected", kind=fault.kind.value, step=step, rank=self.rank)
            os.kill(os.getpid(), signal.SIGKILL)
