"""Deterministic, balanced data sharding.

The global sample order is a function of (seed, epoch) only; a step takes the next
``global_batch`` positions of that order and rank r takes its contiguous slice of them.
So every rank gets exactly ``batch_size`` samples per step, the data position is just the
step number (checkpointed with the weights), and the order does not depend on the world
size: a resharded run that keeps the global batch sees the same samples.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np


@lru_cache(maxsize=4)
def epoch_order(n: int, seed: int, epoch: int) -> np.ndarray:
    """Permutation of ``range(n)`` for ``epoch`` (PCG64: identical on every platform)."""
    rng = np.random.Generator(np.random.PCG64([seed, epoch]))
    return rng.permutation(n)


def global_positions(step: int, global_batch: int) -> range:
    return range(step * global_batch, (step + 1) * global_batch)


def shard_indices(*, n: int, seed: int, step: int, batch_size: int, world_size: int,
                  rank: int) -> list[int]:
    """Sample indices rank ``rank`` trains on at ``step``.

    Raises:
        ValueError: ``rank`` outside the world or an empty data set.
    """
    if n <= 0:
        raise ValueError("the training set is empty")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside world of size {world_size}")
    start = step * batch_size * world_size + rank * batch_size
    out = []
    for p in range(start, start + batch_size):
        epoch, offset = divmod(p, n)
        out.append(int(epoch_order(n, seed, epoch)[offset]))
    return out
