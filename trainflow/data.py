"""Deterministic, balanced data sharding.

The global sample order is a function of (seed, epoch) only; a step takes the next
``global_batch`` positions of that order and rank r takes its contiguous slice of them
(``split``: equal slices, or as equal as they can be when the world does not divide the
batch). The data position is the number of samples taken so far, ``step × global_batch``
while the global batch never changes (checkpointed with the weights as the step), and the
order does not depend on the world size: a resharded run that keeps the global batch sees
the same samples at every step, and one that changes it continues at the position its
checkpoint recorded, so within an epoch no sample is skipped or seen twice.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import numpy as np


@lru_cache(maxsize=4)
def epoch_order(n: int, seed: int, epoch: int) -> np.ndarray:
    """Permutation of ``range(n)`` for ``epoch`` (PCG64: identical on every platform)."""
    rng = np.random.Generator(np.random.PCG64([seed, epoch]))
    return rng.permutation(n)


def global_positions(step: int, global_batch: int) -> range:
    return range(step * global_batch, (step + 1) * global_batch)


def split(global_batch: int, world_size: int, rank: int) -> range:
    """Rank ``rank``'s slice of a step's ``global_batch`` positions (offsets in the step):
    contiguous, sizes differing by at most one, larger slices first. Pure."""
    base, extra = divmod(global_batch, world_size)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (rank < extra))


def indices_at(*, n: int, seed: int, positions: range) -> list[int]:
    """Sample indices at global ``positions`` of the (seed, epoch) orders."""
    if n <= 0:
        raise ValueError("the training set is empty")
    out = []
    for p in positions:
        epoch, offset = divmod(p, n)
        out.append(int(epoch_order(n, seed, epoch)[offset]))
    return out


def shard_indices(*, n: int, seed: int, step: int, batch_size: int, world_size: int, rank: int) -> list[int]:
    """Sample indices rank ``rank`` trains on at ``step`` of a fixed-size gang
    (``batch_size`` per rank, so position ``step × batch_size × world_size``).

    Raises:
        ValueError: ``rank`` outside the world or an empty data set.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside world of size {world_size}")
    start = step * batch_size * world_size + rank * batch_size
    return indices_at(n=n, seed=seed, positions=range(start, start + batch_size))


def rank_positions(*, position: int, global_batch: int, world_size: int, rank: int) -> range:
    """Global positions rank ``rank`` takes in the step that starts at ``position``.

    Raises:
        ValueError: ``rank`` outside the world, or fewer samples than ranks.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside world of size {world_size}")
    if global_batch < world_size:
        raise ValueError(f"a global batch of {global_batch} cannot feed {world_size} ranks")
    part = split(global_batch, world_size, rank)
    return range(position + part.start, position + part.stop)


def sample_lineage(run_dir: Path) -> dict[int, list[int]]:
    """step → the sample indices the final weights learned from at that step, in rank order,
    from a run recorded with ``record_samples`` (``samples/rank-<r>.jsonl``).

    A step trained again after a restart (work lost since the last checkpoint, or a gang
    that changed size) counts as trained by the gang that trained it last: per step, the
    entries of the world size written last, one per rank, the newest of each.

    Raises:
        ValueError: a step's last gang is missing a rank's entry (the log is incomplete).
    """
    by_step: dict[int, dict[int, dict[int, dict]]] = {}
    for path in sorted((Path(run_dir) / "samples").glob("rank-*.jsonl")):
        rank = int(path.stem.split("-")[1])
        for line in path.read_text().splitlines():
            try:
                entry = json.loads(line)
            except ValueError:
                continue  # a line cut short by a killed worker
            latest = by_step.setdefault(entry["step"], {}).setdefault(entry["world"], {})
            if rank not in latest or entry["time"] >= latest[rank]["time"]:
                latest[rank] = entry
    out = {}
    for step, worlds in sorted(by_step.items()):
        world = max(worlds, key=lambda w: max(e["time"] for e in worlds[w].values()))
        ranks = worlds[world]
        if sorted(ranks) != list(range(world)):
            raise ValueError(f"step {step}: sample log has ranks {sorted(ranks)} of a world of {world}")
        out[step] = [i for r in sorted(ranks) for i in ranks[r]["indices"]]
    return out
