"""Hugging Face ``Trainer`` under trainflow: progress, verified checkpoints, resume, preemption.

::

    from trainflow.adapters.hf import TrainflowCallback, output_dir, resume_from

    args = TrainingArguments(output_dir=output_dir("out"), save_strategy="steps", save_steps=100, ...)
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[TrainflowCallback()])
    trainer.train(resume_from_checkpoint=resume_from())

The callback reports every step (the loss when the Trainer logs it), commits each
``checkpoint-N`` the Trainer saves (trainflow seals it once every rank has: manifest,
digests), stops at a preemption after saving, and marks the end. Resume from
``resume_from()``: the newest *verified* checkpoint or None — never
``resume_from_checkpoint=True``, which fails when no checkpoint exists and trusts the
highest-numbered folder whether or not it was completely written.
"""

from __future__ import annotations

from pathlib import Path

from transformers import TrainerCallback

from trainflow import sdk


def output_dir(default: str) -> str:
    """Where the Trainer writes its ``checkpoint-N`` folders: inside the run's checkpoint
    directory under trainflow (so a committed folder moves into place), else ``default``."""
    root = sdk.checkpoint_dir()
    return str(root / "hf") if root is not None else default


def resume_from() -> str | None:
    """The checkpoint to pass as ``resume_from_checkpoint`` (None on a fresh start)."""
    return sdk.resume_from()


class TrainflowCallback(TrainerCallback):
    """Reports progress, commits saved checkpoints, honours preemption."""

    def __init__(self) -> None:
        self._loss: float | None = None

    def on_log(self, args, state, control, logs=None, **kwargs):
        numbers = {k: float(v) for k, v in (logs or {}).items() if isinstance(v, (int, float))}
        if "loss" in numbers:
            self._loss = numbers["loss"]
        sdk.report(state.global_step, **numbers)

    def on_step_end(self, args, state, control, **kwargs):
        sdk.report(state.global_step, **({"loss": self._loss} if self._loss is not None else {}))
        if sdk.should_stop():
            control.should_save = True
            control.should_training_stop = True
        return control

    def on_save(self, args, state, control, **kwargs):
        folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        if sdk.active() and folder.is_dir():
            sdk.commit_dir(state.global_step, folder)

    def on_train_end(self, args, state, control, **kwargs):
        sdk.done(state.global_step, **({"loss": self._loss} if self._loss is not None else {}))


__all__ = ["TrainflowCallback", "output_dir", "resume_from"]
