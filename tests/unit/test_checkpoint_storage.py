"""The pieces of trainflow's DCP storage layer that need no process group."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch

from trainflow.checkpoint import dcp


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.BatchNorm1d(64), torch.nn.Linear(64, 3))


def _state(model: torch.nn.Module) -> dict:
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 16)).sum().backward()
    opt.step()
    return {"model": model.state_dict(), "optim": opt.state_dict()}


def _tensors(d: dict, path: tuple = ()) -> dict:
    out = {}
    for key, value in d.items():
        if isinstance(value, dict):
            out.update(_tensors(value, (*path, key)))
        elif isinstance(value, torch.Tensor):
            out[(*path, key)] = value
    return out


@pytest.mark.parametrize("world", [1, 2, 3, 8])
def test_share_gives_every_replicated_tensor_to_exactly_one_rank(world):
    model = _model()
    state = _state(model)
    shares = [_tensors(dcp._share(state, model, r, world)) for r in range(world)]
    everything = _tensors(state)
    owners = {path: [r for r, share in enumerate(shares) if path in share] for path in everything}
    assert all(len(ranks) == 1 for ranks in owners.values()), owners
    assert all(shares[r][p] is everything[p] for p in everything for r in owners[p])  # no copies
    # Rank 0 holds the BatchNorm statistics (DDP broadcasts rank 0's at each forward).
    buffers = [p for p in everything if p[0] == "model" and p[1].startswith("1.running")]
    assert buffers and all(owners[p] == [0] for p in buffers)
    loads = [sum(t.nbytes for t in share.values()) for share in shares]
    biggest = max(t.nbytes for t in everything.values())
    assert max(loads) - min(loads) <= biggest  # greedy by size: within one tensor of even


def test_share_keeps_non_tensors_everywhere_and_ignores_key_order():
    model = _model()
    state = _state(model)
    reordered = {"optim": state["optim"], "model": dict(reversed(list(state["model"].items())))}
    for rank in range(2):
        share = dcp._share(state, model, rank, 2)
        assert share["optim"]["param_groups"] is state["optim"]["param_groups"]
        assert _tensors(dcp._share(reordered, model, rank, 2)).keys() == _tensors(share).keys()


def test_write_file_returns_the_digest_of_what_is_on_disk(tmp_path):
    buffers = [dcp._as_bytes(torch.arange(n, dtype=dtype))
               for n, dtype in [(1000, torch.float32), (0, torch.float32), (7, torch.bfloat16), (3, torch.int64)]]
    buffers.append(memoryview(b"pickled bytes"))
    size, sha = dcp._write_file(tmp_path / "f", buffers)
    data = (tmp_path / "f").read_bytes()
    assert size == len(data) == 4000 + 14 + 24 + 13
    assert sha == hashlib.sha256(data).hexdigest()


def test_write_file_error_leaves_no_hashing_thread(tmp_path):
    import threading

    before = threading.active_count()
    with pytest.raises(OSError):
        dcp._write_file(tmp_path / "missing-dir" / "f", [memoryview(b"x")])
    assert threading.active_count() == before


@pytest.mark.parametrize("where", ["tmp_path", "/dev/shm"])
def test_direct_writes_keep_every_byte_and_the_digest(tmp_path, where):
    """O_DIRECT through the aligned bounce buffer (ext4 here), or the buffered fallback
    (tmpfs): odd sizes, buffers across the 8 MiB bounce boundary, the tail's padding trimmed."""
    import os

    import numpy as np

    root = tmp_path if where == "tmp_path" else Path(where)
    if not root.is_dir():
        pytest.skip(f"{where} missing")
    rng = np.random.default_rng(0)
    for sizes in ([1], [4095, 1, (8 << 20) - 7, 3], [(8 << 20) * 2], []):
        bufs = [memoryview(rng.integers(0, 255, n, dtype=np.uint8)) for n in sizes]
        path = root / f"tf-direct-{os.getpid()}.bin"
        try:
            size, sha = dcp._write_file(path, bufs)
            want = b"".join(bytes(b) for b in bufs)
            assert size == len(want) and path.read_bytes() == want
            assert sha == hashlib.sha256(want).hexdigest()
        finally:
            path.unlink(missing_ok=True)
