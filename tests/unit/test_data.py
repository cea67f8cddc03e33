from __future__ import annotations

from collections import Counter

import pytest

from trainflow.data import shard_indices


def _epoch(n, world, batch, seed=7):
    steps = n // (world * batch)
    return [
        i
        for s in range(steps)
        for r in range(world)
        for i in shard_indices(n=n, seed=seed, step=s, batch_size=batch, world_size=world, rank=r)
    ]


@pytest.mark.parametrize("world,batch", [(1, 8), (2, 4), (4, 2)])
def test_an_epoch_sees_every_sample_once(world, batch):
    seen = _epoch(64, world, batch)
    assert Counter(seen) == Counter(range(64))


def test_order_is_independent_of_world_size_when_global_batch_is_kept():
    assert _epoch(64, 2, 4) == _epoch(64, 4, 2) == _epoch(64, 1, 8)


def test_balanced_and_deterministic():
    a = shard_indices(n=100, seed=1, step=3, batch_size=5, world_size=3, rank=2)
    assert a == shard_indices(n=100, seed=1, step=3, batch_size=5, world_size=3, rank=2)
    assert len(a) == 5
    assert a != shard_indices(n=100, seed=2, step=3, batch_size=5, world_size=3, rank=2)


def test_batches_cross_epoch_boundaries():
    idx = shard_indices(n=10, seed=0, step=1, batch_size=8, world_size=1, rank=0)
    assert len(idx) == 8 and all(0 <= i < 10 for i in idx)


def test_bad_rank_raises():
    with pytest.raises(ValueError, match="rank 2 outside"):
        shard_indices(n=10, seed=0, step=0, batch_size=1, world_size=2, rank=2)


def test_uneven_split_covers_the_global_batch_once():
    from trainflow.data import rank_positions, split

    for world in (1, 2, 3, 5, 7):
        parts = [split(32, world, r) for r in range(world)]
        assert [i for p in parts for i in p] == list(range(32))
        assert max(map(len, parts)) - min(map(len, parts)) <= 1
    got = [i for r in range(3) for i in rank_positions(position=96, global_batch=32, world_size=3, rank=r)]
    assert got == list(range(96, 128))
    with pytest.raises(ValueError, match="cannot feed"):
        rank_positions(position=0, global_batch=2, world_size=3, rank=0)


def test_fixed_size_positions_are_unchanged():
    """The elastic position arithmetic gives a fixed-size gang exactly the old indices."""
    from trainflow.data import indices_at, rank_positions, shard_indices

    for step in (0, 7, 50):
        for rank in range(3):
            pos = rank_positions(position=step * 48, global_batch=48, world_size=3, rank=rank)
            assert indices_at(n=100, seed=5, positions=pos) == shard_indices(
                n=100, seed=5, step=step, batch_size=16, world_size=3, rank=rank
            )
