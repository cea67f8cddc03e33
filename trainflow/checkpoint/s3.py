"""The S3 tier of the checkpoint store (boto3): S3 and S3-compatible stores (MinIO,
SeaweedFS, Alibaba OSS, Huawei OBS, Tencent COS) through ``endpoint_url``.

Layout: ``s3://<bucket>/<prefix>/<tenant>/<dag_id>/<run_id>/step-<s>/<files>``, the
checkpoint's own files and its ``manifest.json`` uploaded **last**: an S3 checkpoint
without a manifest is incomplete and never used. Integrity end to end:

- upload: every file is hashed as the transfer reads it and must match its manifest
  entry; every object (each part of a multipart one) carries a CRC32C the server checks on
  receipt (a single-part file of an older checkpoint whose manifest records a SHA-256
  carries that instead); afterwards every object's size (and such a SHA-256) is compared
  with the manifest, and only then is the manifest written;
- download: into ``step-<s>.partial``, every file's digest (BLAKE3, or an older
  checkpoint's SHA-256) computed as it arrives (from the page cache, as the written
  prefix grows) and checked against the manifest, then renamed into place — a copy is
  complete and verified or absent.

Transfers run through boto3's transfer manager (multipart, concurrent parts and files);
throttling and 5xx answers are retried with exponential backoff by botocore's
``standard`` retry mode. Credentials come from the caller (an Airflow Connection, read
on the operator side) or boto3's standard chain — never from the spec, XComs or logs.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
import shutil
import socket
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping
from urllib.parse import urlparse

from trainflow.checkpoint import manifest
from trainflow.errors import CheckpointError
from trainflow.workspace import DAG_ID_PATTERN, RUN_ID_PATTERN, check_name

log = logging.getLogger(__name__)

MiB = 2**20
TENANT_PATTERN = r"^[a-z0-9][a-z0-9-]{0,62}$"
# Credential-bearing keys a caller may pass; the others are client settings.
_SECRET_KEYS = ("aws_access_key_id", "aws_secret_access_key", "aws_session_token")


@dataclass(frozen=True)
class TransferSettings:
    """Multipart and concurrency settings (defaults suit checkpoint shards of 10 MB-10 GB)."""

    multipart_threshold: int = 16 * MiB
    chunk_size: int = 16 * MiB
    concurrency: int = 8
    max_attempts: int = 8  # per request, botocore's standard retry mode (throttling, 5xx)
    # A download's reads and writes (boto3's default is 256 KiB): 4 MiB takes the
    # per-chunk Python work (a write, a hash update) down 16-fold; bench/s3_sync.py measured
    # the raw download of 268 MB 0.31 → 0.27 s and trainflow's verified one 0.38 → 0.28 s.
    io_chunk_size: int = 4 * MiB

    def transfer_config(self):
        from boto3.s3.transfer import TransferConfig

        return TransferConfig(
            multipart_threshold=self.multipart_threshold,
            multipart_chunksize=self.chunk_size,
            max_concurrency=self.concurrency,
            io_chunksize=self.io_chunk_size,
            use_threads=True,
        )


def client(
    *,
    endpoint_url: str | None = None,
    region_name: str | None = None,
    settings: TransferSettings = TransferSettings(),
    **credentials: str,
):
    """A boto3 S3 client with retries and a connection pool sized for the concurrency.

    ``credentials``: ``aws_access_key_id``/``aws_secret_access_key``/``aws_session_token``
    (from an Airflow Connection); none: boto3's standard chain (environment, profile,
    instance role). ``endpoint_url``: an S3-compatible store (or ``AWS_ENDPOINT_URL_S3``).
    """
    import boto3
    from botocore.config import Config

    unknown = set(credentials) - set(_SECRET_KEYS)
    if unknown:
        raise ValueError(f"unknown S3 client settings {sorted(unknown)}")
    config = Config(
        retries={"mode": "standard", "max_attempts": settings.max_attempts},
        max_pool_connections=max(10, settings.concurrency * 2),
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
        s3={"addressing_style": "path"} if endpoint_url else None,
    )
    return boto3.session.Session().client(
        "s3",
        endpoint_url=endpoint_url,
        region_name=region_name or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1",
        config=config,
        **{k: v for k, v in credentials.items() if v},
    )


def parse_uri(uri: str) -> tuple[str, str]:
    """``s3://bucket/prefix`` → (bucket, prefix without slashes).

    Raises:
        CheckpointError: not an s3 URI with a bucket.
    """
    parsed = urlparse(uri)
    if parsed.scheme != "s3" or not parsed.netloc:
        raise CheckpointError(f"not an S3 store URI: {uri!r}; use s3://bucket/prefix")
    return parsed.netloc, parsed.path.strip("/")


def _digest_downloaded(path: Path, algorithm: str) -> str:
    """The digest of a file the download has written, hashed from the page cache through a
    memory map (no copy into a read buffer). Mapping is safe here because the file sits in
    the download's private directory: nothing else truncates it while it is hashed (a
    truncated mapping would fault)."""
    import mmap

    h = manifest.hasher(algorithm)
    with open(path, "rb") as fh:
        if os.fstat(fh.fileno()).st_size:
            try:
                mapped = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
            except (OSError, ValueError):  # a filesystem that cannot map
                return manifest.file_digest(path, algorithm)
            with mapped:
                h.update(mapped)
    return h.hexdigest()


class _HashingSink:
    """A download target that hashes its file's bytes in order while the ranges arrive.

    Seekable: the transfer writes every range at its offset as it comes (s3transfer's one
    I/O thread calls ``seek`` then ``write``), so its parallel ranged GETs never wait on
    each other. (A non-seekable target takes s3transfer's in-order path, whose window of 10
    buffered chunks is shared by every file of a download: with more files than request
    threads, every thread waited for a slot in it and nothing ran that would free one — a
    checkpoint of 16 files of 32 MB hung for good with s3transfer 0.19.3.)

    The file is sized up front (the manifest's size) and mapped read-only; each write is
    recorded as a written interval, and whenever the written prefix grows, the file's
    hashing thread (its own, or one a download shares among several files: one per CPU)
    hashes the new stretch from the page cache through the map. So the
    hash keeps pace with the download and nothing waits in memory for it: the sink holds no
    data, and nothing is hashed after the last range lands but that range. (The first
    seekable sink kept pieces ahead of the prefix in memory until the hash reached them:
    in experiments beside bench/s3_sync.py it ran at 0.72x the raw download's speed on two
    shared cores; hashing each file once it was complete, 0.92x.) A range written twice (a GET retried
    after part of it had arrived), a write beyond the expected size or a file of another
    size leave the prefix in doubt: the file is then hashed again from the disk."""

    def __init__(self, path: Path, algorithm: str, size: int, hasher: ThreadPoolExecutor | None = None) -> None:
        import mmap

        self.path, self.algorithm, self.expected = Path(path), algorithm, int(size)
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        self.pos = 0  # where the next write goes
        self.prefix = 0  # bytes [0, prefix) are written and handed to the hash
        self.written: dict[int, int] = {}  # start → end of each write beyond the prefix
        self.in_doubt = False
        self.hash = manifest.hasher(algorithm)
        # One thread (updates stay in order), the file's own or shared with other files.
        self.owns_hasher = hasher is None
        self.hasher = hasher or ThreadPoolExecutor(max_workers=1)
        self.hashing = None  # the newest update queued (the thread runs them in order)
        self.map = None
        try:
            if self.expected > 0:
                os.ftruncate(self.fd, self.expected)
                self.map = mmap.mmap(self.fd, self.expected, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as exc:  # a filesystem that cannot map: hashed from disk at the end
            log.info("%s: cannot map the file (%s); it is hashed after the download", self.path.name, exc)
            self.in_doubt = True
        except BaseException:
            os.close(self.fd)
            raise

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        if whence != os.SEEK_SET:
            raise ValueError("a download sink seeks to absolute offsets only")
        self.pos = int(offset)
        return self.pos

    def tell(self) -> int:
        return self.pos

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        start, done = self.pos, 0
        while done < len(view):
            done += os.pwrite(self.fd, view[done:], start + done)
        self.pos += done
        if self.in_doubt:
            return done
        if start < self.prefix or start in self.written or self.pos > self.expected:
            self.in_doubt = True
            return done
        self.written[start] = self.pos
        grown = self.prefix
        while grown in self.written:
            grown = self.written.pop(grown)
        if grown > self.prefix:
            self.hashing = self.hasher.submit(self._update, self.prefix, grown)
            self.prefix = grown
        return done

    def _update(self, start: int, end: int) -> None:
        try:
            with memoryview(self.map) as whole, whole[start:end] as stretch:
                self.hash.update(stretch)
        except Exception:  # noqa: BLE001 - the file is hashed again from the disk instead
            log.exception("%s: hashing bytes %d-%d failed", self.path.name, start, end)
            self.in_doubt = True

    def finish(self) -> tuple[str, int]:
        """Close; the file's digest and size."""
        self.close()
        size = self.path.stat().st_size
        if self.in_doubt or self.written or self.prefix != self.expected or size != self.expected:
            log.info("%s: a range was written twice or out of step; hashing the file again", self.path.name)
            return _digest_downloaded(self.path, self.algorithm), size
        return self.hash.hexdigest(), size

    def close(self) -> None:
        if self.owns_hasher:
            self.hasher.shutdown(wait=True)
        if self.hashing is not None:  # a shared thread: wait for this file's updates
            self.hashing.exception()
            self.hashing = None
        if self.map is not None:
            self.map.close()
            self.map = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class _HashingSource:
    """An upload source that hashes the bytes as the transfer reads them: each file is read
    once, in order (it is not seekable, so the transfer reads its parts one after another
    and sends them concurrently), and what was sent is checked against the manifest's
    digest before the manifest is written. No separate verification pass reads the files
    before the upload, and a file that changed after its manifest was written is caught
    whatever the store can check."""

    def __init__(self, path: Path, algorithm: str) -> None:
        self.fh = open(path, "rb")
        self.hash = manifest.hasher(algorithm)
        self.size = 0

    def read(self, amount: int = -1) -> bytes:
        data = self.fh.read(amount)
        self.hash.update(data)
        self.size += len(data)
        return data

    def seekable(self) -> bool:
        return False

    def close(self) -> None:
        self.fh.close()


def part_checksum() -> str:
    """The checksum each uploaded object (part) carries for the server to check: CRC32C,
    which the AWS common runtime computes with the CPU's CRC instruction (10 GB/s per core
    here, five times zlib's CRC32); CRC32 where that runtime is not installed."""
    from botocore.compat import HAS_CRT

    return "CRC32C" if HAS_CRT else "CRC32"


def _check_path(rel: str, whose: str) -> None:
    """A manifest's file name must stay inside its checkpoint directory."""
    if ".." in Path(rel).parts or rel.startswith("/"):
        raise CheckpointError(f"manifest of {whose} names an unsafe path {rel!r}")


def _b64(hex_digest: str) -> str:
    return base64.b64encode(bytes.fromhex(hex_digest)).decode()


class S3Store:
    """One run's checkpoints under ``s3://bucket/<prefix>/<tenant>/<dag>/<run>/``."""

    def __init__(
        self,
        s3,
        bucket: str,
        prefix: str,
        *,
        tenant: str,
        dag_id: str,
        run_id: str,
        settings: TransferSettings = TransferSettings(),
    ) -> None:
        parts = [p for p in prefix.split("/") if p]
        if any(p in (".", "..") for p in parts):
            raise CheckpointError(f"S3 prefix {prefix!r} must not contain '.' or '..'")
        names = [
            check_name("tenant", tenant, TENANT_PATTERN),
            check_name("dag_id", dag_id, DAG_ID_PATTERN),
            check_name("run_id", run_id, RUN_ID_PATTERN),
        ]
        self.s3, self.bucket, self.settings = s3, bucket, settings
        self.root = "/".join(parts + names)

    @property
    def uri(self) -> str:
        return f"s3://{self.bucket}/{self.root}"

    def _key(self, step: int, rel: str = "") -> str:
        return f"{self.root}/step-{step:08d}" + (f"/{rel}" if rel else "")

    def _listed(self, step: int) -> dict[str, dict]:
        """The objects stored under step ``step``: relative name → its listing (Size, ETag)."""
        prefix = self._key(step) + "/"
        return {
            o["Key"][len(prefix) :]: o
            for page in self.s3.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix)
            for o in page.get("Contents", [])
        }

    def _manager(self):
        from boto3.s3.transfer import create_transfer_manager

        return create_transfer_manager(self.s3, self.settings.transfer_config())

    # -- listing ----------------------------------------------------------------------
    def steps(self) -> list[int]:
        """Steps with a manifest in the store (committed uploads), newest first."""
        found = set()
        paginator = self.s3.get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=self.bucket, Prefix=self.root + "/step-"):
            for obj in page.get("Contents", []):
                name, _, rest = obj["Key"][len(self.root) + 1 :].partition("/")
                if rest == manifest.MANIFEST and name[5:].isdigit():
                    found.add(int(name[5:]))
        return sorted(found, reverse=True)

    def read_manifest(self, step: int) -> dict:
        body = self.s3.get_object(Bucket=self.bucket, Key=self._key(step, manifest.MANIFEST))["Body"].read()
        return json.loads(body)

    # -- upload -----------------------------------------------------------------------
    def upload(self, ref: manifest.CheckpointRef) -> dict[str, Any]:
        """Upload the committed checkpoint ``ref``; idempotent (an upload with the same
        manifest is kept). Returns ``{"step", "uri", "bytes", "seconds", "skipped"}``.

        Every file is hashed as it is read for the upload (``_HashingSource``) and must
        match its manifest entry; the manifest goes up last, only then.

        Raises:
            CheckpointError: a file does not match its manifest entry, or an object's size
                or digest in the store differs from the manifest (the manifest is then not
                written: the step stays incomplete in the store and is never used).
        """
        local = Path(ref.path)
        body = (local / manifest.MANIFEST).read_bytes()
        try:
            existing = self.s3.get_object(Bucket=self.bucket, Key=self._key(ref.step, manifest.MANIFEST))
            if existing["Body"].read() == body:
                return {
                    "step": ref.step,
                    "uri": self.uri + f"/step-{ref.step:08d}",
                    "bytes": ref.bytes,
                    "seconds": 0.0,
                    "skipped": True,
                }
        except self.s3.exceptions.NoSuchKey:
            pass
        data = json.loads(body)
        if data.get("training_hash") != ref.training_hash:
            raise CheckpointError(
                f"{local}: its manifest's training hash {data.get('training_hash')} is not "
                f"{ref.training_hash}; not uploading it"
            )
        files = data["files"]
        t0 = time.perf_counter()
        sources: dict[str, _HashingSource] = {}
        try:
            with self._manager() as tm:
                futures = []
                for rel in sorted(files):
                    _check_path(rel, str(local))
                    sources[rel] = _HashingSource(local / rel, manifest.entry_digest(files[rel])[0])
                    futures.append(
                        tm.upload(
                            sources[rel],
                            self.bucket,
                            self._key(ref.step, rel),
                            extra_args=self._checksum_args(files[rel]),
                        )
                    )
                for f in futures:
                    f.result()
        except OSError as exc:
            raise CheckpointError(f"{local} cannot be read for the upload: {exc}") from exc
        finally:
            for source in sources.values():
                source.close()
        bad = []
        for rel, source in sources.items():
            if source.size != int(files[rel]["size"]):
                bad.append(f"{rel} ({source.size} bytes read, {files[rel]['size']} in the manifest)")
            elif source.hash.hexdigest() != manifest.entry_digest(files[rel])[1]:
                bad.append(f"{rel} (digest differs)")
        if bad:
            raise CheckpointError(
                f"{local} does not match its manifest: {', '.join(bad[:5])}; "
                f"the manifest of step {ref.step} was not uploaded"
            )
        self._check_uploaded(ref.step, files)
        self.s3.put_object(
            Bucket=self.bucket,
            Key=self._key(ref.step, manifest.MANIFEST),
            Body=body,
            ChecksumSHA256=_b64(hashlib.sha256(body).hexdigest()),
        )
        return {
            "step": ref.step,
            "uri": self.uri + f"/step-{ref.step:08d}",
            "bytes": ref.bytes,
            "seconds": time.perf_counter() - t0,
            "skipped": False,
        }

    def _checksum_args(self, meta: Mapping[str, Any]) -> dict[str, str]:
        """Every object carries a CRC32C (per part for a multipart upload; ``part_checksum``),
        checked by the server as the bytes arrive; a single-part file whose manifest records
        a SHA-256 (a checkpoint of an earlier version) carries that instead, which the server
        checks with no hashing on this side. S3 has no BLAKE3: the manifest's digest is
        checked as each file is read for the upload and on every download."""
        if int(meta["size"]) < self.settings.multipart_threshold and "sha256" in meta:
            return {"ChecksumSHA256": _b64(meta["sha256"])}
        return {"ChecksumAlgorithm": part_checksum()}

    def _check_uploaded(self, step: int, files: Mapping[str, Mapping[str, Any]]) -> None:
        def head(rel: str) -> str | None:
            h = self.s3.head_object(Bucket=self.bucket, Key=self._key(step, rel), ChecksumMode="ENABLED")
            meta = files[rel]
            if int(h["ContentLength"]) != int(meta["size"]):
                return f"{rel}: {h['ContentLength']} bytes in the store, {meta['size']} in the manifest"
            digest = h.get("ChecksumSHA256")
            if digest and "-" not in digest and "sha256" in meta and digest != _b64(meta["sha256"]):
                return f"{rel}: SHA-256 in the store differs from the manifest"
            return None

        with ThreadPoolExecutor(max_workers=self.settings.concurrency) as pool:
            problems = [p for p in pool.map(head, sorted(files)) if p]
        if problems:
            raise CheckpointError(
                f"upload of step {step} to {self.uri} does not match its manifest: " + "; ".join(problems[:5])
            )

    # -- download ---------------------------------------------------------------------
    def download(self, step: int, dest_root: Path, *, training_hash: str | None = None) -> manifest.CheckpointRef:
        """Fetch step ``step`` into ``dest_root/step-<s>`` verified (partial, then rename);
        a local copy that already verifies with the same manifest is kept.

        Raises:
            CheckpointError: the copy does not verify (nothing is left in place).
        """
        dest_root = Path(dest_root)
        body = self.s3.get_object(Bucket=self.bucket, Key=self._key(step, manifest.MANIFEST))["Body"].read()
        dest = manifest.step_dir(dest_root, step)
        if dest.exists():
            ref = manifest.verify(dest, training_hash=training_hash)
            if ref is not None and ref.manifest_sha256 == hashlib.sha256(body).hexdigest():
                return ref
        files = json.loads(body)["files"]
        # Private to this download: nodes of a gang may share ``dest_root`` and have equal pids.
        tmp = manifest.partial_dir(dest_root, step).with_name(
            f"step-{step:08d}.download-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        )
        tmp.mkdir(parents=True)
        try:
            # One listing: a file missing from the store, or of another size than its
            # manifest entry, fails here as a CheckpointError (so ``newest`` goes on to an
            # older checkpoint) before a byte is fetched.
            stored = self._listed(step)
            for rel in sorted(files):
                _check_path(rel, f"step {step}")
                if rel not in stored or stored[rel]["Size"] != files[rel]["size"]:
                    raise CheckpointError(
                        f"step {step} in {self.uri}: {rel} is "
                        + ("missing" if rel not in stored else f"{stored[rel]['Size']} bytes, not {files[rel]['size']}")
                        + " as its manifest records"
                    )
            digests = self._fetch(step, files, tmp)
            bad = [
                rel
                for rel, (digest, size) in digests.items()
                if digest != manifest.entry_digest(files[rel])[1] or size != files[rel]["size"]
            ]
            if bad:
                raise CheckpointError(
                    f"step {step} downloaded from {self.uri} does not verify against "
                    f"its manifest: {', '.join(sorted(bad)[:5])}"
                )
            (tmp / manifest.MANIFEST).write_bytes(body)
            ref = manifest.CheckpointRef(
                step=step,
                path=str(dest),
                world_size=int(json.loads(body)["world_size"]),
                training_hash=str(json.loads(body)["training_hash"]),
                manifest_sha256=hashlib.sha256(body).hexdigest(),
                bytes=sum(int(m["size"]) for m in files.values()),
            )
            if training_hash is not None and ref.training_hash != training_hash:
                raise CheckpointError(
                    f"step {step} in {self.uri} belongs to another training "
                    f"(hash {ref.training_hash}, not {training_hash})"
                )
            if dest.exists():
                shutil.rmtree(dest, ignore_errors=True)
            try:
                os.rename(tmp, dest)
            except OSError:  # another node fetched the same step at the same moment
                done = manifest.verify(dest, training_hash=training_hash)
                if done is None or done.manifest_sha256 != ref.manifest_sha256:
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return ref

    def _fetch(self, step: int, files: dict, tmp: Path) -> dict[str, tuple[str, int]]:
        """Download step ``step``'s ``files`` into ``tmp``; each file's (digest, size).

        Every file is hashed while it downloads (_HashingSink), the files sharing a hashing
        thread per CPU (a file always the same one)."""
        sinks: dict[str, _HashingSink] = {}
        hashers = [ThreadPoolExecutor(max_workers=1) for _ in range(max(1, min(len(files), os.cpu_count() or 1)))]
        try:
            with self._manager() as tm:
                pending = []
                for i, rel in enumerate(sorted(files)):
                    (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
                    sinks[rel] = _HashingSink(
                        tmp / rel, manifest.entry_digest(files[rel])[0], files[rel]["size"], hashers[i % len(hashers)]
                    )
                    pending.append(tm.download(self.bucket, self._key(step, rel), sinks[rel]))
                for fut in pending:
                    fut.result()
            return {rel: sink.finish() for rel, sink in sinks.items()}
        finally:
            for sink in sinks.values():
                sink.close()
            for pool in hashers:
                pool.shutdown(wait=True)

    def newest(
        self, dest_root: Path, *, training_hash: str | None = None, world_size: int | None = None
    ) -> manifest.CheckpointRef | None:
        """Download and return the newest store checkpoint that verifies (and fits
        ``training_hash``/``world_size``); older ones are tried when a newer one fails."""
        for step in self.steps():
            meta = self.read_manifest(step)
            if training_hash is not None and meta.get("training_hash") != training_hash:
                continue
            if world_size is not None and meta.get("world_size") != world_size:
                continue
            try:
                return self.download(step, dest_root, training_hash=training_hash)
            except CheckpointError as exc:
                log.warning("store checkpoint %s skipped: %s", step, exc)
        return None

    # -- retention --------------------------------------------------------------------
    def prune(self, keep: int) -> list[int]:
        """Delete all but the ``keep`` newest committed checkpoints (manifest first, so a
        half-deleted one is already incomplete) and any upload without a manifest older
        than the newest."""
        steps = self.steps()
        doomed = steps[keep:]
        for step in doomed:
            self.s3.delete_object(Bucket=self.bucket, Key=self._key(step, manifest.MANIFEST))
            keys = [o["Key"] for o in self._listed(step).values()]
            for i in range(0, len(keys), 1000):
                self.s3.delete_objects(
                    Bucket=self.bucket, Delete={"Objects": [{"Key": k} for k in keys[i : i + 1000]], "Quiet": True}
                )
        return doomed
