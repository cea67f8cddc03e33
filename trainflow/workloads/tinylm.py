"""``tinylm``: a small byte-level transformer LM on the Python standard library's source.

The corpus is a fixed, hashed selection of the running interpreter's own ``.py`` files
(real text present on every machine, no download). Files are picked and ordered by the
SHA-256 of their relative path, so the selection is stable for a given Python version;
its fingerprint goes into the run report. Evaluation reports held-out bits per byte and
the unigram (byte-frequency) baseline on the same held-out bytes.
"""

from __future__ import annotations

import hashlib
import math
import sysconfig
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

from trainflow.workloads.base import Workload

if TYPE_CHECKING:
    from trainflow.spec import TrainingSpec

TRAIN_BYTES = 1_500_000
EVAL_BYTES = 120_000
CONTEXT = 64
EVAL_WINDOWS = 256
_SKIP = ("site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__")


@lru_cache(maxsize=1)
def corpus() -> tuple[bytes, bytes, str]:
    """Return (train bytes, held-out bytes, fingerprint) from the stdlib's sources."""
    root = Path(sysconfig.get_paths()["stdlib"])
    picks: list[tuple[str, Path]] = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root).as_posix()
        if any(part in _SKIP for part in rel.split("/")):
            continue
        picks.append((hashlib.sha256(rel.encode()).hexdigest(), path))
    picks.sort()
    train, held = bytearray(), bytearray()
    for digest, path in picks:
        bucket = int(digest[:8], 16) % 10
        target, cap = (held, EVAL_BYTES) if bucket == 0 else (train, TRAIN_BYTES)
        if len(target) < cap:
            target += path.read_bytes()[: cap - len(target)] + b"\n"
        if len(train) >= TRAIN_BYTES and len(held) >= EVAL_BYTES:
            break
    fp = hashlib.sha256(bytes(train) + b"|" + bytes(held)).hexdigest()[:16]
    return bytes(train), bytes(held), fp


def unigram_bits_per_byte(train: bytes, held: bytes) -> float:
    """Cross-entropy (bits/byte) of add-one-smoothed byte frequencies of ``train`` on ``held``."""
    counts = [1] * 256
    for b in train:
        counts[b] += 1
    total = sum(counts)
    held_counts = [0] * 256
    for b in held:
        held_counts[b] += 1
    return -sum(c * math.log2(counts[b] / total) for b, c in enumerate(held_counts) if c) / len(held)


class _Windows:
    def __init__(self, data, context: int, stride: int):
        self.data, self.context, self.stride = data, context, stride

    def __len__(self) -> int:
        return (len(self.data) - self.context - 1) // self.stride

    def __getitem__(self, i):
        w = self.data[i * self.stride : i * self.stride + self.context + 1]
        return w[:-1], w[1:]


def _model(context: int, d: int = 128, heads: int = 4, layers: int = 2):
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

        def forward(self, x):
            b, t, _ = x.shape
            q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, heads, d // heads).unbind(2)
            a = nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
            )
            x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
            return x + self.mlp(self.ln2(x))

    class TinyLM(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok = nn.Embedding(256, d)
            self.pos = nn.Parameter(torch.zeros(context, d))
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.ln = nn.LayerNorm(d)
            self.head = nn.Linear(d, 256)

        def forward(self, idx):
            x = self.tok(idx) + self.pos[: idx.shape[1]]
            for blk in self.blocks:
                x = blk(x)
            return self.head(self.ln(x))

    return TinyLM()


def build(spec: "TrainingSpec") -> Workload:
    import torch
    from torch import nn

    train_bytes, held_bytes, fingerprint = corpus()
    train = torch.frombuffer(bytearray(train_bytes), dtype=torch.uint8).long()
    held = torch.frombuffer(bytearray(held_bytes), dtype=torch.uint8).long()
    model = _model(CONTEXT)
    baseline = unigram_bits_per_byte(train_bytes, held_bytes)

    def loss(m, batch):
        x, y = batch
        return nn.functional.cross_entropy(m(x).flatten(0, 1), y.flatten())

    @torch.no_grad()
    def evaluate(m):
        m.eval()
        # Windows spread evenly over the whole held-out text, not just its first file.
        stride = max(1, (len(held) - CONTEXT - 1) // EVAL_WINDOWS)
        windows = _Windows(held, CONTEXT, stride)
        n = min(len(windows), EVAL_WINDOWS)
        x = torch.stack([windows[i][0] for i in range(n)])
        y = torch.stack([windows[i][1] for i in range(n)])
        nats = float(nn.functional.cross_entropy(m(x).flatten(0, 1), y.flatten()))
        bpb = nats / math.log(2)
        return {
            "bits_per_byte": bpb,
            "unigram_bits_per_byte": baseline,
            "improvement_over_unigram": baseline / bpb,
            "eval_bytes": n * CONTEXT,
        }

    return Workload(
        model=model,
        train=_Windows(train, CONTEXT, CONTEXT // 2),
        loss=loss,
        evaluate=evaluate,
        shard_modules=list(model.blocks),
        target=("improvement_over_unigram", ">=", 2.0),
        info={
            "corpus_fingerprint": fingerprint,
            "train_bytes": len(train_bytes),
            "eval_bytes": len(held_bytes),
            "unigram_bits_per_byte": baseline,
            "context": CONTEXT,
        },
    )
