"""``digits``: a small CNN on scikit-learn's bundled 8×8 handwritten digits (offline)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainflow.workloads.base import Workload

if TYPE_CHECKING:
    from trainflow.spec import TrainingSpec

HELD_OUT = 0.2


def load_data():
    """Return ((x_train, y_train), (x_test, y_test)); a fixed split, whatever the seed."""
    import numpy as np
    import torch
    from sklearn.datasets import load_digits

    ds = load_digits()
    x = torch.tensor(ds.images / 16.0, dtype=torch.float32).unsqueeze(1)
    y = torch.tensor(ds.target, dtype=torch.long)
    order = torch.from_numpy(np.random.Generator(np.random.PCG64(1234)).permutation(len(y)))
    cut = int(len(y) * (1 - HELD_OUT))
    tr, te = order[:cut], order[cut:]
    return (x[tr], y[tr]), (x[te], y[te])


class _Pairs:
    def __init__(self, x, y):
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def build(spec: "TrainingSpec") -> Workload:
    import torch
    from torch import nn

    (xtr, ytr), (xte, yte) = load_data()
    model = nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(32 * 4 * 4, 64),
        nn.ReLU(),
        nn.Linear(64, 10),
    )

    def loss(m, batch):
        x, y = batch
        return nn.functional.cross_entropy(m(x), y)

    @torch.no_grad()
    def evaluate(m):
        m.eval()
        logits = m(xte)
        return {
            "accuracy": float((logits.argmax(1) == yte).float().mean()),
            "loss": float(nn.functional.cross_entropy(logits, yte)),
            "samples": len(yte),
        }

    return Workload(
        model=model,
        train=_Pairs(xtr, ytr),
        loss=loss,
        evaluate=evaluate,
        target=("accuracy", ">=", 0.95),
        info={"train_samples": len(ytr), "eval_samples": len(yte), "source": "sklearn.datasets.load_digits"},
    )
