"""The pieces of trainflow's DCP storage layer that need no process group."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from blake3 import blake3

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


@pytest.mark.integration  # real worker processes
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
    buffers = [
        dcp._as_bytes(torch.arange(n, dtype=dtype))
        for n, dtype in [(1000, torch.float32), (0, torch.float32), (7, torch.bfloat16), (3, torch.int64)]
    ]
    buffers.append(memoryview(b"pickled bytes"))
    offsets, size, sha = dcp._write_file(tmp_path / "f", buffers)
    data = (tmp_path / "f").read_bytes()
    assert size == len(data) == 4000 + 14 + 24 + 13  # small buffers: packed, no padding
    assert offsets == [0, 4000, 4000, 4014, 4038]
    assert sha == blake3(data).hexdigest()


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
    for sizes in ([1], [4095, 1, (8 << 20) - 7, 3], [(8 << 20) * 2], [], [70000, 5, 1 << 20, 65536, 9]):
        # Slices at odd addresses too, so that heads, tails and gaps all occur.
        bufs = [memoryview(rng.integers(0, 255, n + 9, dtype=np.uint8))[i % 9 : i % 9 + n] for i, n in enumerate(sizes)]
        path = root / f"tf-direct-{os.getpid()}.bin"
        try:
            offsets, size, sha = dcp._write_file(path, bufs)
            data = path.read_bytes()
            assert size == len(data)
            assert all(data[o : o + len(b)] == bytes(b) for o, b in zip(offsets, bufs))
            assert offsets == sorted(offsets) and all(
                o + len(b) <= nxt for o, b, nxt in zip(offsets, bufs, offsets[1:] + [size])
            )
            assert size - sum(len(b) for b in bufs) <= 4095 * len(bufs)  # gaps under a block each
            assert sha == blake3(data).hexdigest()
        finally:
            path.unlink(missing_ok=True)


def test_layout_writes_large_buffers_from_their_own_memory():
    """A large buffer's aligned middle is one direct piece at an aligned file offset; its
    head and tail, small buffers and the gaps go through the bounce buffer."""
    import numpy as np

    big = np.zeros((1 << 20) + 4096, dtype=np.uint8)
    odd = memoryview(big)[100 : 100 + (1 << 20)]  # an address that is not block-aligned
    small = memoryview(bytearray(1000))
    offsets, pieces, size = dcp._layout([small, odd, memoryview(b"read-only bytes")])
    direct = [(off, data) for off, data, is_direct in pieces if is_direct]
    assert len(direct) == 1
    off, data = direct[0]
    assert off % dcp._ALIGN == 0 and len(data) % dcp._ALIGN == 0 and dcp._address(data) % dcp._ALIGN == 0
    assert len(data) >= (1 << 20) - dcp._ALIGN
    assert offsets[0] == 0 and offsets[1] >= 1000 and offsets[2] == offsets[1] + (1 << 20)
    # The pieces tile the file with no gap and no overlap.
    ends = [o + len(d) for o, d, _ in pieces]
    assert [o for o, _, _ in pieces] == [0, *ends[:-1]] and ends[-1] == size
