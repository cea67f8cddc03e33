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
    KILL_RANK = "kill_rank"            # SIGKILL the rank's worker process (process fault)
    KILL_NODE = "kill_node"            # SIGKILL the node's shard_train task (or agent) and its tree
    STOP_RANK = "stop_rank"            # SIGSTOP the rank (a hang: alive but no progress)
    CORRUPT_CHECKPOINT = "corrupt_checkpoint"  # flip bytes in the newest checkpoint, then kill the rank
    RAISE = "raise"                    # a deterministic user bug: ValueError in the workload
    CRASH_RANK = "crash_rank"          # SIGKILL the rank every time it reaches the step (crash loop)
    SLOW_RANK = "slow_rank"            # from the step on, the rank computes 4× slower (a straggler)


ONCE = {FaultKind.KILL_RANK, FaultKind.KILL_NODE, FaultKind.STOP_RANK, FaultKind.CORRUPT_CHECKPOINT}


@dataclass(frozen=True, kw_only=True)
class Fault:
    """One scheduled fault: ``kind`` fires when ``rank`` reaches ``step``."""

    kind: FaultKind
    step: int
    rank: int = 0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["kind"] = self.kind.value
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
        unknown = set(item) - {"kind", "step", "rank"}
        if unknown:
            raise SpecError(f"faults[{i}]", item, f"unknown keys {sorted(unknown)}; use kind, step, rank")
        try:
            kind = FaultKind(item.get("kind"))
        except ValueError:
            raise SpecError(f"faults[{i}].kind", item.get("kind"),
                            f"use one of {', '.join(k.value for k in FaultKind)}") from None
        step, rank = item.get("step"), item.get("rank", 0)
        for name, v in (("step", step), ("rank", rank)):
            if isinstance(v, bool) or not isinstance(v, int):
                raise SpecError(f"faults[{i}].{name}", v, "must be an integer")
        if not 1 <= step <= steps:
            raise SpecError(f"faults[{i}].step", step, f"must be between 1 and steps ({steps})")
        if not 0 <= rank < world_size:
            raise SpecError(f"faults[{i}].rank", rank, f"must be a rank of the gang (0..{world_size - 1})")
        out.append(Fault(kind=kind, step=step, rank=rank))
    return tuple(out)


class FaultInjector:
    """Fires the faults of one rank (runs inside the worker)."""

    def __init__(self, faults: Iterable[Fault], *, run_dir: Path, rank: int) -> None:
        self.run_dir, self.rank = Path(run_dir), rank
        self.pending = [(i, f) for i, f in enumerate(faults) if f.rank == rank]
        self.slow_from = min((f.step for f in faults if f.rank == rank and f.kind == FaultKind.SLOW_RANK),
                             default=None)

    def slowdown(self, step: int, compute_s: float) -> None:
        """Stretch this step's compute time when a slow_rank fault is active."""
        if self.slow_from is not None and step >= self.slow_from:
            import time

            time.sleep(3 * compute_s + 0.002)

    def _claim(self, index: int) -> bool:
        """Create the fault's marker atomically; False if it already fired."""
        marker = self.run_dir / "faults" / f"fault-{index}.fired"
        marker.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        os.close(fd)
        return True

    def before_step(self, step: int) -> None:
        """Fire faults scheduled at ``step`` (called before the step trains)."""
        for index, fault in self.pending:
            if fault.step != step or fault.kind in (FaultKind.CORRUPT_CHECKPOINT, FaultKind.SLOW_RANK):
                continue
            if fault.kind == FaultKind.RAISE:
                raise ValueError(f"injected user bug at step {step} on rank {self.rank}")
            if fault.kind == FaultKind.CRASH_RANK:
                record(self.run_dir, "fault_injected", kind=fault.kind.value, step=step, rank=self.rank)
                os.kill(os.getpid(), signal.SIGKILL)
            if not self._claim(index):
                continue
            print(f"[rank {self.rank}] FAULT INJECTED: {fault.kind.value} at step {step}", flush=True)
            record(self.run_dir, "fault_injected", kind=fault.kind.value, step=step, rank=self.rank)
            if fault.kind == FaultKind.KILL_RANK:
                os.kill(os.getpid(), signal.SIGKILL)
            elif fault.kind == FaultKind.STOP_RANK:
                os.kill(os.getpid(), signal.SIGSTOP)
            elif fault.kind == FaultKind.KILL_NODE:
                # The node task's process under Airflow, else the agent; the rest of the
                # tree follows through PDEATHSIG.
                target = int(os.environ.get("TRAINFLOW_NODE_TASK_PID") or
                             os.environ.get("TRAINFLOW_AGENT_PID", "0"))
                if target:
                    os.kill(target, signal.SIGKILL)
                os.kill(os.getpid(), signal.SIGKILL)

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
