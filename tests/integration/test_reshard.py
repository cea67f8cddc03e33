"""A checkpoint written by a gang of one world size loads bit-exact into a gang of another
(what an elastic gang's shrink and grow rely on): DDP and FSDP2, 3 → 2 and 2 → 3 ranks,
model *and optimizer state* (AdamW moments and step), compared by digest of the full
(unsharded) state before the save and after the load. Real torchrun gangs on gloo."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


def _worker(phase: str, out: Path) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    from trainflow.checkpoint import dcp, manifest

    sys.path.insert(0, str(Path(__file__).parent))
    from test_checkpoint_dcp import _digest

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    def net(seed: int):
        torch.manual_seed(seed)
        return torch.nn.Sequential(torch.nn.Linear(33, 130), torch.nn.ReLU(), torch.nn.Linear(130, 7))

    def build(kind: str, seed: int):
        model = net(seed)
        if kind == "fsdp":
            fully_shard(model[0])
            fully_shard(model)
        else:
            model = DDP(model)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    def full(model, opt) -> str:
        m, o = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
        return _digest({"model": m, "optim": o})

    seen = {}
    for kind in ("ddp", "fsdp"):
        root = out / kind
        if phase == "save":
            model, opt = build(kind, 0)
            gen = torch.Generator().manual_seed(rank)
            for _ in range(3):
                opt.zero_grad()
                model(torch.randn(8, 33, generator=gen)).square().mean().backward()
                opt.step()
            dcp.save(model, opt, root=root, step=3, world_size=world, training_hash="t", keep_last=1)
            seen[kind] = full(model, opt)
        else:
            model, opt = build(kind, 1)
            path = [str(manifest.newest_verified(root).path) if rank == 0 else None]
            dist.broadcast_object_list(path, src=0)
            dcp.load(model, opt, path[0])
            seen[kind] = full(model, opt)
    if rank == 0:
        (out / f"{phase}-{world}.json").write_text(json.dumps(seen))
    dist.barrier()
    dist.destroy_process_group()


def _gang(phase: str, out: Path, world: int) -> dict:
    env = {
        **os.environ,
        "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo"),
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(Path(__file__).resolve().parents[2]),
    }
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={world}",
            __file__,
            phase,
            str(out),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return json.loads((out / f"{phase}-{world}.json").read_text())


@pytest.mark.parametrize("saved_by, loaded_by", [(3, 2), (2, 3)], ids=["shrink-3-to-2", "grow-2-to-3"])
def test_checkpoint_loads_bit_exact_across_world_sizes(tmp_path, saved_by, loaded_by):
    saved = _gang("save", tmp_path, saved_by)
    loaded = _gang("load", tmp_path, loaded_by)
    assert loaded == saved  # DDP and FSDP2: model and AdamW state, every bit


if __name__ == "__main__":
    _worker(sys.argv[1], Path(sys.argv[2]))
