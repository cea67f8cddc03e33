"""The tiered store's moving parts on a ``file://`` durable store: the background upload
while training runs, and hydration by several nodes of a gang at once."""

from __future__ import annotations

import threading
import time

from trainflow.checkpoint import manifest
from trainflow.checkpoint.store import BackgroundPublisher, hydrate, open_store


def _save(root, step, hash_="h1", world=2):
    part = manifest.partial_dir(root, step)
    part.mkdir(parents=True)
    (part / "__0_0.distcp").write_bytes(b"w" * 1000 + bytes([step % 256]))
    (part / ".metadata").write_bytes(b"meta" + bytes([step % 256]))
    return manifest.commit(root, step, world_size=world, training_hash=hash_)


def _wait(publisher: BackgroundPublisher, store, step: int) -> None:
    deadline = time.time() + 30
    while step not in store.steps():
        assert time.time() < deadline, f"step {step} never uploaded: {store.steps()}"
        publisher.poll()
        time.sleep(0.05)
    publisher.close()


def test_new_verified_checkpoints_are_uploaded_as_they_appear(tmp_path):
    run_dir = tmp_path / "run"
    store = open_store((tmp_path / "durable").as_uri(), "t", "dag", "run1")
    pub = BackgroundPublisher(run_dir, store, training_hash="h1", world_size=2, keep_last=2)
    pub.poll()  # nothing local yet: nothing happens
    assert store.steps() == []
    for step in (10, 20, 30):
        _save(run_dir / "checkpoints", step)
        _wait(pub, store, step)
    assert store.steps() == [30, 20]  # the store keeps keep_last
    assert [p["step"] for p in pub.published] == [10, 20, 30]
    pub.poll()
    pub.close()
    assert len(pub.published) == 3  # nothing new: nothing uploaded again


def test_checkpoints_of_another_training_or_a_corrupt_one_are_not_uploaded(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    store = open_store((tmp_path / "durable").as_uri(), "t", "dag", "run1")
    pub = BackgroundPublisher(run_dir, store, training_hash="h1", world_size=2, keep_last=2)
    _save(run_dir / "checkpoints", 10)
    _wait(pub, store, 10)
    _save(run_dir / "checkpoints", 20, hash_="other")
    bad = _save(run_dir / "checkpoints", 30)
    (manifest.step_dir(run_dir / "checkpoints", 30) / "__0_0.distcp").write_bytes(b"garbage")
    assert bad.step == 30
    verified = []
    real = manifest.newest_verified

    def counting(*a, **kw):
        verified.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(manifest, "newest_verified", counting)
    for _ in range(5):
        pub.poll()
        pub.close()
    assert store.steps() == [10]
    assert len(verified) == 1  # the corrupt newest is examined once, not at every poll


def test_nodes_hydrating_together_fetch_once_and_agree(tmp_path):
    src = tmp_path / "other-host"
    store = open_store((tmp_path / "durable").as_uri(), "t", "dag", "run1")
    for step in (10, 20):
        store.publish(_save(src, step), keep_last=2)
    run_dir = tmp_path / "run"  # the gang's workspace lost its checkpoints
    got, errors = [], []

    def node() -> None:
        try:
            got.append(hydrate(run_dir, store, training_hash="h1", world_size=2))
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=node) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert {r.step for r in got} == {20} and len({r.manifest_sha256 for r in got}) == 1
    assert [s for s, _ in manifest.list_checkpoints(run_dir / "checkpoints")] == [20]
