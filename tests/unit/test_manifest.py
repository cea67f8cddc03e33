from __future__ import annotations

import json

import pytest

from trainflow.checkpoint import manifest


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
    assert "does not match its sha256" in caplog.text


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
    data["files"]["../secret"] = {"size": 1, "sha256": manifest.sha256_file(tmp_path / "secret")}
    (d / "manifest.json").write_text(json.dumps(data))
    assert manifest.verify(d) is None


def test_prune_keeps_last_k_and_removes_partials(tmp_path):
    for s in (1, 2, 3, 4):
        _save(tmp_path, s)
    manifest.partial_dir(tmp_path, 5).mkdir()
    manifest.prune(tmp_path, 2)
    assert [s for s, _ in manifest.list_checkpoints(tmp_path)] == [4, 3]
    assert not list(tmp_path.glob("*.partial"))
