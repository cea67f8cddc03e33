"""Checkpoints: sharded DCP saves committed atomically with a verified manifest."""

from trainflow.checkpoint.manifest import (
    CheckpointRef,
    list_checkpoints,
    newest_verified,
    prune,
    verify,
)

__all__ = ["CheckpointRef", "list_checkpoints", "newest_verified", "prune", "verify"]
