"""Durable checkpoint stores: ``file://`` (a directory, e.g. a shared mount) and ``s3://``
(``trainflow.checkpoint.s3``), behind one interface (``open_store``): ``publish`` a
verified local checkpoint, ``fetch_newest`` the newest verified copy back.

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


class FileStore:
    """A run's durable checkpoints in a directory (``file:///dir``)."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    @property
    def uri(self) -> str:
        return self.root.as_uri()

    def steps(self) -> list[int]:
        return [s for s, _ in manifest.list_checkpoints(self.root)]

    def publish(self, ref: manifest.CheckpointRef, keep_last: int) -> dict:
        out = publish(ref, self.root, keep_last)
        return {"step": out.step, "uri": Path(out.path).as_uri(), "bytes": out.bytes}

    def fetch_newest(
        self, dest_root: Path, *, training_hash: str | None = None, world_size: int | None = None
    ) -> manifest.CheckpointRef | None:
        ref = manifest.newest_verified(self.root, training_hash=training_hash, world_size=world_size)
        return publish(ref, Path(dest_root), keep_last=10**6) if ref is not None else None


class S3Tier:
    """A run's durable checkpoints in S3 (``s3://bucket/prefix``)."""

    def __init__(self, store) -> None:
        self.store = store

    @property
    def uri(self) -> str:
        return self.store.uri

    def steps(self) -> list[int]:
        return self.store.steps()

    def publish(self, ref: manifest.CheckpointRef, keep_last: int) -> dict:
        done = self.store.upload(ref)  # every byte sent is checked against the manifest
        self.store.prune(keep_last)
        return done

    def fetch_newest(
        self, dest_root: Path, *, training_hash: str | None = None, world_size: int | None = None
    ) -> manifest.CheckpointRef | None:
        return self.store.newest(dest_root, training_hash=training_hash, world_size=world_size)


def open_store(store_uri: str, tenant: str, dag_id: str, run_id: str, *, s3_client=None):
    """The run's durable store for ``store_uri`` (None: the workspace is the store).

    Args:
        s3_client: a boto3 client for ``s3://`` URIs (made by the caller from an Airflow
            Connection or the standard chain; default: ``s3.client()`` on the chain).
    """
    if not store_uri:
        return None
    if store_uri.startswith("s3://"):
        from trainflow.checkpoint import s3

        bucket, prefix = s3.parse_uri(store_uri)
        return S3Tier(s3.S3Store(s3_client or s3.client(), bucket, prefix, tenant=tenant, dag_id=dag_id, run_id=run_id))
    return FileStore(durable_root(store_uri, tenant, dag_id, run_id))


def hydrate(
    run_dir: Path, store, *, training_hash: str | None = None, world_size: int | None = None
) -> manifest.CheckpointRef | None:
    """Bring the store's newest verified checkpoint into the workspace when it is newer
    than the newest local one (the local copy was lost with its host); returns the
    checkpoint a resume will use, or None."""
    import fcntl

    local_root = Path(run_dir) / "checkpoints"
    if store is None:
        return manifest.newest_verified(local_root, training_hash=training_hash, world_size=world_size)
    local_root.mkdir(parents=True, exist_ok=True)
    # The nodes of a gang retried together share the workspace: one fetches, the others
    # then find the copy in place.
    with open(local_root / ".hydrate.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _hydrate(local_root, store, training_hash, world_size)


def _hydrate(
    local_root: Path, store, training_hash: str | None, world_size: int | None
) -> manifest.CheckpointRef | None:
    local = manifest.newest_verified(local_root, training_hash=training_hash, world_size=world_size)
    remote_steps = store.steps()
    if not remote_steps or (local is not None and local.step >= max(remote_steps)):
        return local
    fetched = store.fetch_newest(local_root, training_hash=training_hash, world_size=world_size)
    if fetched is None or (local is not None and local.step >= fetched.step):
        return local
    return fetched


class BackgroundPublisher:
    """Publish each new verified checkpoint of a workspace to the durable store while the
    training runs (the tiered store's asynchronous upload): ``poll`` is cheap and never
    blocks; one upload runs at a time, always of the newest checkpoint; a failed upload
    (throttling past the retries, a checkpoint pruned locally meanwhile) is retried at the
    next poll with whatever is newest then.

    Args:
        run_dir: the run's workspace.
        store: the durable store (``open_store``).
        training_hash, world_size: what a checkpoint must fit to be published.
        keep_last: checkpoints the store keeps.
    """

    def __init__(
        self, run_dir: Path, store, *, training_hash: str | None, world_size: int | None, keep_last: int, log=None
    ) -> None:
        import logging

        self.root = Path(run_dir) / "checkpoints"
        self.store, self.keep_last = store, keep_last
        self.training_hash, self.world_size = training_hash, world_size
        self.log = log or logging.getLogger(__name__)
        self.published: list[dict] = []
        self._last = -1  # newest step uploaded (or found in the store)
        self._seen = -1  # newest committed step examined: a corrupt one is hashed once, not per poll
        self._thread = None

    def poll(self) -> None:
        import threading

        if self._thread is not None and self._thread.is_alive():
            return
        newest = next(iter(manifest.list_checkpoints(self.root)), None)
        if newest is None or newest[0] <= max(self._last, self._seen):
            return
        self._seen = newest[0]
        self._thread = threading.Thread(target=self._publish, name="checkpoint-upload", daemon=True)
        self._thread.start()

    def _publish(self) -> None:
        try:
            ref = manifest.newest_verified(self.root, training_hash=self.training_hash, world_size=self.world_size)
            if ref is None or ref.step <= self._last:
                return
            if ref.step not in self.store.steps():
                done = self.store.publish(ref, self.keep_last)
                self.published.append(done)
                self.log.info("checkpoint step %d uploaded to %s", ref.step, done["uri"])
            self._last = ref.step
        except Exception as exc:  # noqa: BLE001 - an upload is retried at the next poll
            self._seen = self._last
            self.log.warning("checkpoint upload failed, retried at the next poll: %s: %s", type(exc).__name__, exc)

    def close(self, timeout: float = 300.0) -> None:
        """Wait for the upload in flight (if any)."""
        if self._thread is not None:
            self._thread.join(timeout)


def durable_root(store_uri: str, tenant: str, dag_id: str, run_id: str) -> Path | None:
    """Where a run's durable checkpoints live; None when the workspace is the store."""
    if not store_uri:
        return None
    try:
        parsed = urlparse(store_uri)
    except ValueError as exc:  # e.g. an unbalanced '[' (urllib reads it as an IPv6 host)
        raise CheckpointError(f"unsupported checkpoint store {store_uri!r}: {exc}") from exc
    if parsed.scheme != "file" or not parsed.path.startswith("/") or "\x00" in parsed.path:
        raise CheckpointError(
            f"unsupported checkpoint store {store_uri!r}; use file:///absolute/dir or s3://bucket/prefix"
        )
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
