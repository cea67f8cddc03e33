#!/usr/bin/env python3
"""A Hugging Face ``Trainer`` program under trainflow: a tiny GPT-2 (built from its config,
no download) learns bytes of the Python standard library's own source.

Runs as it is under ``torchrun`` (the callback does nothing there)::

    torchrun --standalone --nproc-per-node 2 examples/hf_program.py --steps 200

and as a trainflow run (``program``: ``["python", "/path/examples/hf_program.py", "--steps",
"200"]``), where it reports progress, commits every checkpoint the Trainer saves and resumes
from the newest verified one.
"""

from __future__ import annotations

import argparse
import os
import sysconfig
import time
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

from trainflow.adapters.hf import TrainflowCallback, output_dir, resume_from

CONTEXT = 64


class Bytes(torch.utils.data.Dataset):
    """Windows of ``CONTEXT`` bytes from the first stdlib sources (sorted: the same everywhere)."""

    def __init__(self, limit: int = 400_000) -> None:
        root = Path(sysconfig.get_paths()["stdlib"])
        data = bytearray()
        for path in sorted(root.glob("*.py")):
            data += path.read_bytes()
            if len(data) >= limit:
                break
        self.data = torch.tensor(list(data[:limit]), dtype=torch.long)

    def __len__(self) -> int:
        return len(self.data) // CONTEXT - 1

    def __getitem__(self, i):
        x = self.data[i * CONTEXT : (i + 1) * CONTEXT]
        return {"input_ids": x, "labels": x}


class StepTimes(TrainerCallback):
    """``--step-times FILE``: rank 0 appends ``<unix time> <step>`` after every optimizer step
    (what a benchmark reads to compare this same program under torchrun and under trainflow)."""

    def __init__(self, path: str) -> None:
        self.file = open(path, "a", buffering=1) if int(os.environ.get("RANK", "0")) == 0 else None

    def on_step_end(self, args, state, control, **kwargs):
        if self.file is not None:
            self.file.write(f"{time.time():.6f} {state.global_step}\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--save-steps", type=int, default=50)
    parser.add_argument("--out", default="hf-out")
    parser.add_argument("--step-times", help="append '<time> <step>' per step to this file (rank 0)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=CONTEXT, n_embd=64, n_layer=2, n_head=2))
    training = TrainingArguments(
        output_dir=output_dir(args.out),
        max_steps=args.steps,
        per_device_train_batch_size=8,
        learning_rate=3e-3,
        logging_steps=10,
        save_strategy="steps",
        save_steps=args.save_steps,
        report_to=[],
        use_cpu=True,
        ddp_backend="gloo",
        dataloader_num_workers=0,
        seed=0,
        disable_tqdm=True,
    )
    callbacks = [TrainflowCallback(), *([StepTimes(args.step_times)] if args.step_times else [])]
    trainer = Trainer(model=model, args=training, train_dataset=Bytes(), callbacks=callbacks)
    trainer.train(resume_from_checkpoint=resume_from())
    return 0


if __name__ == "__main__":
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    raise SystemExit(main())
