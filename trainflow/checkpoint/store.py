"""Durable checkpoint stores. ``file://`` (a directory, e.g. a shared mount) here; the
S3 tier plugs in behind the same ``publish`` call.

A checkpoint is copied into ``<dest>.partial``, verified against its manifest, then
renamed into place, so the durable copy is either complete and verified or absent.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from urllib.parse import urlparse

from trainflow.checkpoint import manifest
from trainflow.errors import CheckpointError
from trainflow.workspace import Workspace


def durable_root(store_uri: str, tenant: str, dag_id: str, run_id: str) -> Path | None:
    """Where a run's durable checkpoints live; None when the workspace is the store."""
    if not store_uri:
        return None
    parsed = urlparse(store_uri)
    if parsed.scheme != "file" or not parsed.path.startswith("/"):
        raise CheckpointError(f"unsupported checkpoint store {store_uri!r}; use file:///absolute/dir")
    # Workspace checks every component, so the run cannot escape its prefix.
    return Workspace(Path(parsed.path), tenant, dag_id, run_id).dir / "checkpoints"


def publish(ref: manifest.CheckpointRef, dest_root: Path, keep_last: int) -> manifest.CheckpointRef:
    """Copy the verified checkpoint ``ref`` under ``dest_root``; verify; prune to keep K.

    Idempotent: a destination that already verifies with the same manifest is kept.

    Raises:
        CheckpointError: the copy does not verify.
    """
    dest_root.mkdir(parents=True, exist_ok=True)
    dest = manifest.step_dir(dest_root, ref.step)
    existing = manifest.verify(dest) if dest.exists() else None
    if existing is not None and existing.manifest_sha256 == ref.manifest_sha256:
        return existing
    tmp = manifest.partial_dir(dest_root, ref.step)
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(ref.path, tmp)
    copied = manifest.verify(tmp, training_hash=ref.training_hash)
    if copied is None or copied.manifest_sha256 != ref.manifest_sha256:
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"copy of {ref.path} to {dest_root} does not verify")
    if dest.exists():
        shutil.rmtree(dest)
    os.rename(tmp, dest)
    manifest.prune(dest_root, keep_last)
    out = manifest.verify(dest)
    assert out is not None
    return out
