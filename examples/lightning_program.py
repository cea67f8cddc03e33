#!/usr/bin/env python3
"""A Lightning program under trainflow: an MLP on scikit-learn's digits, ``strategy="ddp"``
on CPU, one process per node.

Runs as it is under ``torchrun`` (the callback does nothing there)::

    torchrun --standalone --nproc-per-node 2 examples/lightning_program.py --steps 300 --nodes 1 --devices 2

and as a trainflow run (``program``: ``["python", "/path/examples/lightning_program.py",
"--steps", "300"]``), where it reports progress, commits its checkpoints and resumes from
the newest verified one.
"""

from __future__ import annotations

import argparse
import os

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from trainflow.adapters.lightning import TrainflowCheckpoints, ckpt_path


class Digits(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


def data() -> DataLoader:
    from sklearn.datasets import load_digits

    ds = load_digits()
    x = torch.tensor(ds.data / 16.0, dtype=torch.float32)
    return DataLoader(TensorDataset(x, torch.tensor(ds.target)), batch_size=32, shuffle=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--every", type=int, default=50)
    parser.add_argument(
        "--nodes",
        type=int,
        default=int(os.environ.get("WORLD_SIZE", "1")) // int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
    )
    parser.add_argument("--devices", type=int, default=int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    args = parser.parse_args()
    torch.set_num_threads(1)
    L.seed_everything(0, workers=True)
    trainer = L.Trainer(
        accelerator="cpu",
        strategy="ddp",
        num_nodes=args.nodes,
        devices=args.devices,
        max_steps=args.steps,
        enable_checkpointing=False,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[TrainflowCheckpoints(every_n_steps=args.every)],
    )
    trainer.fit(Digits(), data(), ckpt_path=ckpt_path())
    return 0


if __name__ == "__main__":
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    raise SystemExit(main())
