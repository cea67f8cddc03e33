from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainflow.checkpoint import manifest
from trainflow.errors import CheckpointError


def _save(root, step, payload=b"weights", hash_="h1", world=2):
    part = manifest.partial_dir(root, step)
    part.mkdir(parents=True)
    (part / "__0_0.distcp").write_bytes(payload * 100)
    (part / ".metadata").write_bytes(b"meta" + bytes([step % 256]))
    return manifest.commit(root, step, world_size=world, training_hash=hash_)


def test_commit_writes_manifest_last_and_verifies(tmp_path):
    ref = _save(tmp_path, 10)
    assert ref.step == 10 and ref.world_size == 2
    data = json.loads((tmp_path / "step-00000010" / "manifest.json").read_text())
    assert set(data["files"]) == {"__0_0.distcp", ".metadata"}
    assert not (tmp_path / "step-00000010.partial").exists()
    assert manifest.newest_verified(tmp_path) == ref


def test_corrupt_newest_falls_back_to_previous(tmp_path, caplog):
    _save(tmp_path, 10)
    _save(tmp_path, 20)
    f = tmp_path / "step-00000020" / "__0_0.distcp"
    f.write_bytes(b"X" + f.read_bytes()[1:])  # same size, different bytes
    ref = manifest.newest_verified(tmp_path)
    assert ref.step == 10
    assert "does not match its blake3" in caplog.text


@pytest.mark.parametrize("damage", ["truncate", "delete_file", "delete_manifest", "garbage_manifest"])
def test_damaged_checkpoints_never_verify(tmp_path, damage):
    _save(tmp_path, 5)
    d = tmp_path / "step-00000005"
    if damage == "truncate":
        (d / "__0_0.distcp").write_bytes(b"w")
    elif damage == "delete_file":
        (d / ".metadata").unlink()
    elif damage == "delete_manifest":
        (d / "manifest.json").unlink()
    else:
        (d / "manifest.json").write_text("{not json")
    assert manifest.verify(d) is None
    assert manifest.newest_verified(tmp_path) is None


def test_a_crash_before_commit_leaves_previous_checkpoint(tmp_path):
    _save(tmp_path, 10)
    part = manifest.partial_dir(tmp_path, 20)
    part.mkdir()
    (part / "__0_0.distcp").write_bytes(b"half")
    assert manifest.newest_verified(tmp_path).step == 10


def test_mismatched_run_or_world_is_skipped(tmp_path):
    _save(tmp_path, 10, hash_="other")
    assert manifest.newest_verified(tmp_path, training_hash="mine") is None
    _save(tmp_path, 20, world=4)
    assert manifest.newest_verified(tmp_path, world_size=2).step == 10
    assert manifest.newest_verified(tmp_path, training_hash="h1", world_size=2) is None
    assert manifest.newest_verified(tmp_path, world_size=4).step == 20


def test_manifest_cannot_point_outside_its_directory(tmp_path):
    _save(tmp_path, 1)
    d = tmp_path / "step-00000001"
    data = json.loads((d / "manifest.json").read_text())
    (tmp_path / "secret").write_bytes(b"s")
    data["files"]["../secret"] = {"size": 1, "blake3": manifest.file_digest(tmp_path / "secret")}
    (d / "manifest.json").write_text(json.dumps(data))
    assert manifest.verify(d) is None


def test_prune_keeps_last_k_and_removes_partials(tmp_path):
    for s in (1, 2, 3, 4):
        _save(tmp_path, s)
    manifest.partial_dir(tmp_path, 5).mkdir()
    manifest.prune(tmp_path, 2)
    assert [s for s, _ in manifest.list_checkpoints(tmp_path)] == [4, 3]
    assert not list(tmp_path.glob("*.partial"))


def test_commit_takes_the_writers_digests_and_hashes_the_rest(tmp_path):
    part = manifest.partial_dir(tmp_path, 7)
    part.mkdir()
    (part / "__0_0.distcp").write_bytes(b"a" * 100)
    (part / ".metadata").write_bytes(b"meta")
    # The digest is used as given (commit does not read the file back) ...
    ref = manifest.commit(tmp_path, 7, world_size=1, training_hash="h", digests={"__0_0.distcp": (100, "0" * 64)})
    files = manifest.read_manifest(ref.path)["files"]
    assert files["__0_0.distcp"] == {"size": 100, "blake3": "0" * 64}
    assert files[".metadata"]["blake3"] == manifest.file_digest(tmp_path / "step-00000007" / ".metadata")
    # ... and a wrong one is caught by the verification every resume runs.
    assert manifest.verify(ref.path) is None


@pytest.mark.parametrize(
    "digests, message",
    [
        ({"__0_0.distcp": (99, "0" * 64)}, "its writer wrote 99"),
        ({"__1_0.distcp": (1, "0" * 64)}, "missing from"),
    ],
    ids=["size-differs", "file-missing"],
)
def test_commit_refuses_files_that_differ_from_what_was_written(tmp_path, digests, message):
    part = manifest.partial_dir(tmp_path, 7)
    part.mkdir()
    (part / "__0_0.distcp").write_bytes(b"a" * 100)
    with pytest.raises(CheckpointError, match=message):
        manifest.commit(tmp_path, 7, world_size=1, training_hash="h", digests=digests)
    assert manifest.newest_verified(tmp_path) is None


def test_verify_hashes_every_file(tmp_path):
    part = manifest.partial_dir(tmp_path, 3)
    part.mkdir()
    for rank in range(4):
        (part / f"__{rank}_0.distcp").write_bytes(bytes([rank]) * 1000)
    ref = manifest.commit(tmp_path, 3, world_size=4, training_hash="h")
    assert manifest.verify(ref.path) == ref and ref.bytes == 4000
    victim = tmp_path / "step-00000003" / "__3_0.distcp"
    victim.write_bytes(b"\x00" * 1000)
    assert manifest.verify(ref.path) is None


def test_file_digests_are_blake3_and_sha256_manifests_of_older_versions_still_verify(tmp_path):
    import hashlib

    from blake3 import blake3

    ref = _save(tmp_path, 3)
    files = manifest.read_manifest(ref.path)["files"]
    for rel, meta in files.items():
        data = (Path(ref.path) / rel).read_bytes()
        assert set(meta) == {"size", "blake3"} and meta["blake3"] == blake3(data).hexdigest()
    # a manifest written by an earlier version: SHA-256 per file
    old = json.loads((Path(ref.path) / "manifest.json").read_text())
    for rel, meta in old["files"].items():
        meta["sha256"] = hashlib.sha256((Path(ref.path) / rel).read_bytes()).hexdigest()
        del meta["blake3"]
    (Path(ref.path) / "manifest.json").write_text(json.dumps(old))
    assert manifest.verify(ref.path).step == 3
    rel = sorted(old["files"])[0]
    (Path(ref.path) / rel).write_bytes(b"x" * old["files"][rel]["size"])  # same size, other bytes
    assert manifest.verify(ref.path) is None
    # an entry with a digest this version does not know is refused, named in the log
    old["files"][rel] = {"size": old["files"][rel]["size"], "md5": "0" * 32}
    (Path(ref.path) / "manifest.json").write_text(json.dumps(old))
    assert manifest.verify(ref.path) is None
    with pytest.raises(CheckpointError, match="unknown file digest 'md5'"):
        manifest.hasher("md5")


def test_a_downloaded_file_is_hashed_through_a_map_as_a_read_would_hash_it(tmp_path):
    """The S3 download hashes each finished file through a memory map: the same digest as
    reading it, for either algorithm, and an empty file (which cannot be mapped) too."""
    import random

    from trainflow.checkpoint.s3 import _digest_downloaded

    for name, data in (("empty", b""), ("small", b"x"), ("large", random.Random(3).randbytes(5 * 2**20 + 7))):
        (tmp_path / name).write_bytes(data)
        for algorithm in manifest.DIGESTS:
            want = manifest.hasher(algorithm)
            want.update(data)
            assert _digest_downloaded(tmp_path / name, algorithm) == want.hexdigest(), (name, algorithm)
            assert manifest.file_digest(tmp_path / name, algorithm) == want.hexdigest(), (name, algorithm)


def test_the_download_sink_hashes_the_written_prefix_whatever_order_the_ranges_arrive(tmp_path):
    """The S3 download target: ranges land at their offsets in any order; the digest is of
    the file's bytes in order, computed as the written prefix grows (from the file itself,
    nothing held in memory); a range written twice (a retried GET) or beyond the expected
    size makes it hash the file again from disk."""
    import random

    from trainflow.checkpoint.s3 import _HashingSink

    data = random.Random(3).randbytes(10_000)
    pieces = [(o, data[o : o + 1000]) for o in range(0, len(data), 1000)]
    want = manifest.hasher()
    want.update(data)
    cases = (
        ("in-order", pieces, [], len(data)),
        ("shuffled", random.Random(1).sample(pieces, 10), [], len(data)),
        ("retried", pieces[:6], pieces[2:], len(data)),
        ("longer", pieces, [], len(data) - 1000),
    )
    for name, order, again, expected in cases:
        sink = _HashingSink(tmp_path / name, manifest.DIGEST, expected)
        for offset, piece in order + again:
            assert sink.seek(offset) == offset and sink.tell() == offset
            assert sink.write(piece) == len(piece)
        digest, size = sink.finish()
        assert (tmp_path / name).read_bytes() == data and size == len(data), name
        assert digest == want.hexdigest(), name
        assert sink.in_doubt == (name in ("retried", "longer")), name
        assert not sink.written or sink.in_doubt, name
    empty = _HashingSink(tmp_path / "empty", manifest.DIGEST, 0)
    assert empty.finish() == (manifest.hasher().hexdigest(), 0)


def test_download_sinks_sharing_one_hashing_thread_each_hash_their_own_file_in_order(tmp_path):
    """A download's files share hashing threads: updates of several files interleave on
    one thread, each file's still in order."""
    import random
    from concurrent.futures import ThreadPoolExecutor

    from trainflow.checkpoint.s3 import _HashingSink

    rng = random.Random(5)
    datas = {name: rng.randbytes(20_000 + 13 * i) for i, name in enumerate(("a", "b", "c"))}
    with ThreadPoolExecutor(max_workers=1) as shared:
        sinks = {
            name: _HashingSink(tmp_path / name, manifest.DIGEST, len(data), shared) for name, data in datas.items()
        }
        writes = [(name, o, data[o : o + 1000]) for name, data in datas.items() for o in range(0, len(data), 1000)]
        for name, offset, piece in rng.sample(writes, len(writes)):
            sinks[name].seek(offset)
            sinks[name].write(piece)
        for name, sink in sinks.items():
            want = manifest.hasher()
            want.update(datas[name])
            assert sink.finish() == (want.hexdigest(), len(datas[name])), name
            assert not sink.in_doubt, name
