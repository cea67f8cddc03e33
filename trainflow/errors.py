"""The core error hierarchy. Operators translate these at the Airflow edge.

``SpecError`` (a ``ValueError``) is a user or configuration error and is never retried;
the others are infrastructure errors that a retry may heal. All of them pickle, so they
can cross process boundaries.
"""

from __future__ import annotations


class SpecError(ValueError):
    """Invalid training spec: names the field, the value and the fix."""

    def __init__(self, field: str, value: object, fix: str) -> None:
        self.field = field
        self.value = value
        self.fix = fix
        super().__init__(field, value, fix)

    def __str__(self) -> str:
        return f"invalid {self.field}={self.value!r}: {self.fix}"


class TrainingError(RuntimeError):
    """Base of the infrastructure errors raised while a run trains."""


class LaunchError(TrainingError):
    """The node agent or its workers could not be started or exited abnormally."""


class AdmissionError(TrainingError):
    """The run's gang could not be admitted (not enough free capacity right now)."""


class RendezvousError(TrainingError):
    """The gang could not form its rendezvous."""


class HeartbeatTimeoutError(TrainingError):
    """A rank stopped reporting training progress."""


class WorkerFailedError(TrainingError):
    """A worker rank failed; ``rank`` is the first (root-cause) failure."""

    def __init__(self, rank: int, message: str) -> None:
        self.rank = rank
        self.message = message
        super().__init__(rank, message)

    def __str__(self) -> str:
        return f"rank {self.rank} failed: {self.message}"


class UserCodeError(WorkerFailedError):
    """A worker failed in the workload's own code: retrying cannot help."""


class WorkloadOutputError(TrainingError):
    """The workload returned what trainflow cannot publish (unbounded or malformed metrics):
    its own fault, retrying cannot help; the message names the value and the fix."""


class CheckpointError(TrainingError):
    """A checkpoint could not be written, read or verified."""


class CrashLoopError(TrainingError):
    """The gang keeps restarting from the same checkpoint: stop instead of retrying."""


class ChipUnavailableError(TrainingError):
    """The worker lacks the chip family's extension: a misrouted or misbuilt worker."""


class RunAbortedError(TrainingError):
    """The run was stopped for a reason no retry can heal (a bug in user code, a crash
    loop, a worker without its chip extension): every node task fails at once."""


class PreflightError(TrainingError):
    """A node failed its preflight (cordoned host, chip health, disk, rendezvous) and
    did not join the gang; a retry may place it on a healthy host."""
