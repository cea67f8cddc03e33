"""Lightning ``Trainer`` under trainflow: progress, verified checkpoints, resume, preemption.

::

    from trainflow.adapters.lightning import TrainflowCheckpoints, ckpt_path

    trainer = L.Trainer(accelerator="cpu", strategy="ddp", num_nodes=2, devices=1, max_steps=600,
                        callbacks=[TrainflowCheckpoints(every_n_steps=100)], enable_checkpointing=False)
    trainer.fit(model, data, ckpt_path=ckpt_path())

The callback reports every step with the training loss, saves a checkpoint every
``every_n_steps`` (and at the last step, and when a preemption asks the run to stop) into
the directory trainflow gives (``model.ckpt``), commits it on every rank, and marks the
end. ``ckpt_path()`` is the newest *verified* checkpoint's file, or None.
"""

from __future__ import annotations

from pathlib import Path

import lightning as L

from trainflow import sdk

CKPT = "model.ckpt"


def ckpt_path() -> str | None:
    resume = sdk.resume_from()
    return str(Path(resume) / CKPT) if resume else None


class TrainflowCheckpoints(L.Callback):
    def __init__(self, every_n_steps: int) -> None:
        self.every = int(every_n_steps)
        self._loss: float | None = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if loss is not None:
            self._loss = float(loss)
        sdk.report(step, **({"loss": self._loss} if self._loss is not None else {}))
        stop = sdk.should_stop()
        if sdk.active() and (step % self.every == 0 or step == trainer.max_steps or stop):
            with sdk.checkpoint(step) as path:  # collective: every rank calls save_checkpoint
                trainer.save_checkpoint(path / CKPT)
        if stop:
            trainer.should_stop = True

    def on_train_end(self, trainer, pl_module) -> None:
        sdk.done(trainer.global_step, **({"loss": self._loss} if self._loss is not None else {}))
