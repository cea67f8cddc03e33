"""The S3 checkpoint tier against a real S3 server on loopback (SeaweedFS: data on disk,
SigV4 credentials and SHA-256 checksums enforced), including a fault proxy that answers
with 503 SlowDown / 500 to prove the retries."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import botocore.exceptions
import pytest

from trainflow.checkpoint import manifest
from trainflow.checkpoint.s3 import S3Store, TransferSettings, client, parse_uri
from trainflow.checkpoint.store import hydrate, open_store
from trainflow.errors import CheckpointError, SpecError
from trainflow.spec import TrainingSpec
from trainflow.testing.faultproxy import FaultProxy

THASH = "abc123"
SMALL = TransferSettings(multipart_threshold=5 * 2**20, chunk_size=5 * 2**20, concurrency=4)


def _checkpoint(root: Path, step: int, *, seed: int = 0, big: int = 12 * 2**20) -> manifest.CheckpointRef:
    """A committed checkpoint: one multipart-sized shard, small shards, a nested file."""
    src = manifest.partial_dir(root, step)
    (src / "sub").mkdir(parents=True)
    rng = __import__("random").Random(seed * 1000 + step)
    (src / "__0_0.distcp").write_bytes(rng.randbytes(big))
    (src / "__1_0.distcp").write_bytes(rng.randbytes(3000))
    (src / "sub" / ".metadata").write_bytes(rng.randbytes(100))
    return manifest.commit(root, step, world_size=2, training_hash=THASH, extra={"position": step * 64})


def _store(s3, server, run_id: str, settings=SMALL) -> S3Store:
    return S3Store(
        s3, server.bucket, "ckpt/team-a", tenant="default", dag_id="train_digits", run_id=run_id, settings=settings
    )


def _files(path: Path) -> dict[str, str]:
    return {
        p.relative_to(path).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(path.rglob("*"))
        if p.is_file()
    }


def test_upload_then_download_is_verified_and_identical(tmp_path, s3_server):
    store = _store(s3_server.client(settings=SMALL), s3_server, "run-1")
    ref = _checkpoint(tmp_path / "local", 100)
    done = store.upload(ref)
    assert (
        done["step"] == 100
        and not done["skipped"]
        and done["uri"].endswith("/default/train_digits/run-1/step-00000100")
    )
    assert store.steps() == [100]
    assert store.upload(ref)["skipped"]  # idempotent: the same manifest is already there
    got = store.download(100, tmp_path / "elsewhere", training_hash=THASH)
    assert got.manifest_sha256 == ref.manifest_sha256 and got.step == 100
    assert _files(Path(got.path)) == _files(Path(ref.path))
    assert manifest.read_manifest(Path(got.path))["extra"] == {"position": 6400}
    assert not list((tmp_path / "elsewhere").glob("*.download-*"))


def test_a_checkpoint_of_many_multipart_files_downloads_without_waiting_on_itself(tmp_path, s3_server):
    """Eight files of three ranges each through two request threads: s3transfer's in-order
    path for non-seekable targets shares one window of 10 buffered ranges between them, and
    once both threads waited for a slot to schedule their file's remaining ranges the
    download hung for good (a 16-rank checkpoint with the default settings did). The
    download target is seekable: every range is written where it belongs as it comes."""
    import random
    import threading

    settings = TransferSettings(multipart_threshold=5 * 2**20, chunk_size=5 * 2**20, concurrency=2)
    store = _store(s3_server.client(settings=settings), s3_server, "run-many", settings=settings)
    src = manifest.partial_dir(tmp_path / "local", 100)
    src.mkdir(parents=True)
    rng = random.Random(7)
    for rank in range(8):
        (src / f"__{rank}_0.distcp").write_bytes(rng.randbytes(12 * 2**20))
    ref = manifest.commit(tmp_path / "local", 100, world_size=8, training_hash=THASH)
    store.upload(ref)
    got: dict = {}
    fetch = threading.Thread(
        target=lambda: got.update(ref=store.download(100, tmp_path / "down", training_hash=THASH)), daemon=True
    )
    fetch.start()
    fetch.join(timeout=120)
    assert not fetch.is_alive(), "the download is waiting on itself"
    assert got["ref"].manifest_sha256 == ref.manifest_sha256
    assert _files(Path(got["ref"].path)) == _files(Path(ref.path))


def test_an_upload_without_its_manifest_is_never_used(tmp_path, s3_server):
    s3 = s3_server.client(settings=SMALL)
    store = _store(s3, s3_server, "run-2")
    ref = _checkpoint(tmp_path / "local", 50)
    store.upload(ref)
    partial = _checkpoint(tmp_path / "local", 100)
    for rel in manifest.read_manifest(Path(partial.path))["files"]:  # data, but the upload died before the manifest
        s3.upload_file(str(Path(partial.path) / rel), s3_server.bucket, store._key(100, rel))
    assert store.steps() == [50]
    assert store.newest(tmp_path / "resume", training_hash=THASH).step == 50


def test_a_file_missing_from_the_store_or_of_another_size_fails_before_any_transfer(tmp_path, s3_server):
    s3 = s3_server.client(settings=SMALL)
    store = _store(s3, s3_server, "run-missing")
    store.upload(_checkpoint(tmp_path / "local", 100))
    s3.delete_object(Bucket=s3_server.bucket, Key=store._key(100, "sub/.metadata"))
    with pytest.raises(
        CheckpointError, match=r"step 100 in s3://.*: sub/\.metadata is missing as its manifest records"
    ):
        store.download(100, tmp_path / "a", training_hash=THASH)
    s3.put_object(Bucket=s3_server.bucket, Key=store._key(100, "sub/.metadata"), Body=b"short")
    with pytest.raises(CheckpointError, match=r"sub/\.metadata is 5 bytes, not 100 as its manifest records"):
        store.download(100, tmp_path / "a", training_hash=THASH)
    assert not list((tmp_path / "a").glob("step-*"))
    store.upload(_checkpoint(tmp_path / "local", 50))
    s3.delete_object(Bucket=s3_server.bucket, Key=store._key(100, "sub/.metadata"))
    assert store.newest(tmp_path / "b", training_hash=THASH).step == 50  # a resume goes on to the older copy


def test_ranges_cut_off_mid_body_are_fetched_again_and_the_copy_still_verifies(tmp_path, s3_server, caplog):
    """Every third GET of the files answered with half its body and a closed connection: s3transfer
    fetches the range again from its start, over bytes already written and hashed; the
    target notices the rewrite and hashes the file from disk, and the copy verifies."""
    import logging

    caplog.set_level(logging.INFO, logger="trainflow.checkpoint.s3")
    store = _store(s3_server.client(settings=SMALL), s3_server, "run-cut")
    ref = _checkpoint(tmp_path / "local", 100, big=24 * 2**20)
    store.upload(ref)
    small_reads = TransferSettings(
        multipart_threshold=5 * 2**20, chunk_size=5 * 2**20, concurrency=4, io_chunk_size=256 * 1024
    )
    # Requests 1 and 2 are the manifest and the listing: the cuts fall on the files' GETs.
    with FaultProxy(s3_server.endpoint_url, every=3, start=3, cut=True) as proxy:
        s3 = client(endpoint_url=proxy.endpoint_url, settings=small_reads, **s3_server.credentials)
        via_proxy = S3Store(
            s3,
            s3_server.bucket,
            "ckpt/team-a",
            tenant="default",
            dag_id="train_digits",
            run_id="run-cut",
            settings=small_reads,
        )
        got = via_proxy.download(100, tmp_path / "elsewhere", training_hash=THASH)
    assert proxy.injected >= 2
    assert got.manifest_sha256 == ref.manifest_sha256
    assert _files(Path(got.path)) == _files(Path(ref.path))
    assert "written twice or out of step; hashing the file again" in caplog.text


def test_a_corrupted_object_fails_verification_and_the_older_copy_is_used(tmp_path, s3_server, caplog):
    s3 = s3_server.client(settings=SMALL)
    store = _store(s3, s3_server, "run-3")
    store.upload(_checkpoint(tmp_path / "local", 50))
    store.upload(_checkpoint(tmp_path / "local", 100))
    s3.put_object(Bucket=s3_server.bucket, Key=store._key(100, "__1_0.distcp"), Body=os.urandom(3000))
    with pytest.raises(CheckpointError, match="step 100 downloaded from .* does not verify"):
        store.download(100, tmp_path / "a", training_hash=THASH)
    assert not (tmp_path / "a" / "step-00000100").exists()
    ref = store.newest(tmp_path / "b", training_hash=THASH)
    assert ref.step == 50 and "store checkpoint 100 skipped" in caplog.text


def test_a_wrong_checksum_is_refused_by_the_server(s3_server):
    import base64

    s3 = s3_server.client()
    wrong = base64.b64encode(hashlib.sha256(b"other").digest()).decode()
    with pytest.raises(botocore.exceptions.ClientError, match="BadDigest|XAmzContentSHA256Mismatch|InvalidDigest"):
        s3.put_object(Bucket=s3_server.bucket, Key="x/bad", Body=b"payload", ChecksumSHA256=wrong)


def test_prune_keeps_the_newest(tmp_path, s3_server):
    s3 = s3_server.client(settings=SMALL)
    store = _store(s3, s3_server, "run-4")
    for step in (10, 20, 30, 40):
        store.upload(_checkpoint(tmp_path / "local", step, big=1000))
    assert store.prune(2) == [20, 10]
    assert store.steps() == [40, 30]
    left = s3.list_objects_v2(Bucket=s3_server.bucket, Prefix=store.root + "/step-00000010")
    assert left.get("KeyCount", 0) == 0


def test_wrong_credentials_fail_without_leaking_the_secret(tmp_path, s3_server):
    secret = "not-the-right-secret-4242"
    s3 = client(
        endpoint_url=s3_server.endpoint_url,
        aws_access_key_id=s3_server.access_key,
        aws_secret_access_key=secret,
        settings=TransferSettings(max_attempts=1),
    )
    store = _store(s3, s3_server, "run-5")
    with pytest.raises(botocore.exceptions.ClientError) as err:
        store.upload(_checkpoint(tmp_path / "local", 10, big=1000))
    assert "SignatureDoesNotMatch" in str(err.value) or "AccessDenied" in str(err.value)
    assert secret not in str(err.value) and secret not in repr(err.value)


@pytest.mark.parametrize("status", [503, 500])
def test_throttling_and_server_errors_are_retried_with_backoff(tmp_path, s3_server, status):
    with FaultProxy(s3_server.endpoint_url, every=3, status=status) as proxy:
        s3 = client(endpoint_url=proxy.endpoint_url, **s3_server.credentials, settings=SMALL)
        store = _store(s3, s3_server, f"run-retry-{status}")
        ref = _checkpoint(tmp_path / "local", 10)
        store.upload(ref)
        got = store.download(10, tmp_path / "back", training_hash=THASH)
    assert got.manifest_sha256 == ref.manifest_sha256
    assert proxy.injected >= 3 and proxy.requests > proxy.injected


def test_hydrate_brings_back_what_the_host_lost(tmp_path, s3_server):
    s3 = s3_server.client(settings=SMALL)
    tier = open_store(f"s3://{s3_server.bucket}/ckpt", "default", "train_digits", "run-6", s3_client=s3)
    run_dir = tmp_path / "run"
    for step in (20, 40):
        tier.publish(_checkpoint(run_dir / "checkpoints", step, big=2000), keep_last=3)
    assert hydrate(run_dir, tier, training_hash=THASH).step == 40  # local is as new: nothing fetched
    import shutil

    shutil.rmtree(run_dir / "checkpoints")  # the node's disk went with its host
    ref = hydrate(run_dir, tier, training_hash=THASH)
    assert ref.step == 40 and Path(ref.path).parent == run_dir / "checkpoints"
    assert hydrate(run_dir, None, training_hash=THASH).step == 40


def test_file_store_has_the_same_interface(tmp_path):
    tier = open_store(f"file://{tmp_path / 'durable'}", "default", "train_digits", "run-7")
    run_dir = tmp_path / "run"
    tier.publish(_checkpoint(run_dir / "checkpoints", 30, big=100), keep_last=2)
    import shutil

    shutil.rmtree(run_dir / "checkpoints")
    assert hydrate(run_dir, tier, training_hash=THASH).step == 30


def test_store_uris_are_validated():
    assert parse_uri("s3://bucket-1/a/b/") == ("bucket-1", "a/b")
    with pytest.raises(CheckpointError, match="use s3://bucket/prefix"):
        parse_uri("s3:///nobucket")
    assert TrainingSpec.from_mapping({"store_uri": "s3://ckpt-bucket/team/a"}).store_uri
    for bad in ("s3://UPPER/x", "http://x/y", "s3://b/../x", "s3://ab"):
        with pytest.raises(SpecError):
            TrainingSpec.from_mapping({"store_uri": bad})
    with pytest.raises(CheckpointError, match="must not contain"):
        S3Store(None, "b", "a/../c", tenant="t", dag_id="d", run_id="r")


@pytest.mark.parametrize("changed", ["__1_0.distcp", "__0_0.distcp"], ids=["single-part", "multipart"])
def test_bytes_that_do_not_match_the_manifest_are_refused_and_no_manifest_lands(tmp_path, s3_server, changed):
    """Every file is hashed (BLAKE3) as the upload reads it: a local file that changed after
    its manifest was written (same size, other bytes) fails the upload, single-part or
    multipart, and the step's manifest never lands; the store keeps no usable step."""
    store = _store(s3_server.client(settings=SMALL), s3_server, "run-8")
    ref = _checkpoint(tmp_path / "local", 10)
    shard = Path(ref.path) / changed
    shard.write_bytes(os.urandom(shard.stat().st_size))
    with pytest.raises(
        CheckpointError,
        match=f"does not match its manifest: {changed} \\(digest differs\\); the manifest of step 10 was not uploaded",
    ):
        store.upload(ref)
    assert store.steps() == []
    shard.unlink()
    with pytest.raises(CheckpointError, match="cannot be read for the upload"):
        store.upload(ref)
    assert store.steps() == []


def test_the_server_refuses_an_older_checkpoint_file_that_does_not_match_its_sha256(tmp_path, s3_server):
    """A checkpoint written by an earlier version records SHA-256 digests: its single-part
    objects go up with that SHA-256, so the server itself refuses changed bytes."""
    import json

    store = _store(s3_server.client(settings=SMALL), s3_server, "run-9")
    ref = _checkpoint(tmp_path / "local", 10, big=1000)
    body = json.loads((Path(ref.path) / "manifest.json").read_text())
    for rel, meta in body["files"].items():
        meta["sha256"] = hashlib.sha256((Path(ref.path) / rel).read_bytes()).hexdigest()
        del meta["blake3"]
    (Path(ref.path) / "manifest.json").write_text(json.dumps(body))
    assert not store.upload(ref)["skipped"]
    assert store.download(10, tmp_path / "b", training_hash=THASH).step == 10  # SHA-256 entries verify
    store.prune(0)
    shard = Path(ref.path) / "__1_0.distcp"
    shard.write_bytes(os.urandom(shard.stat().st_size))  # same size, other bytes
    with pytest.raises(botocore.exceptions.ClientError, match="BadDigest|InvalidDigest|XAmzContentSHA256Mismatch"):
        store.upload(ref)
    assert store.steps() == []
