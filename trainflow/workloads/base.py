"""The workload contract and its loader.

A workload is a function ``build(spec) -> Workload``. The built-ins are ``digits`` and
``tinylm``; users plug their own with ``workload="package.module:build"``.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Sequence

from trainflow.errors import SpecError

if TYPE_CHECKING:
    import torch

    from trainflow.spec import TrainingSpec

BUILTINS = {
    "digits": "trainflow.workloads.digits:build",
    "tinylm": "trainflow.workloads.tinylm:build",
}


@dataclass
class Workload:
    """What a worker trains.

    Attributes:
        model: the freshly initialised model (same seed on every rank).
        train: indexable training set; ``train[i]`` is a tuple of tensors.
        loss: ``loss(model, batch) -> scalar tensor`` for a collated batch.
        evaluate: ``evaluate(model) -> {metric: float}`` on held-out data.
        shard_modules: sub-modules FSDP2 shards one by one (the root is always sharded).
        target: ``(metric, ">=" | "<=", value)`` the run is expected to reach.
        info: facts about the data for the run report (sizes, fingerprints, baselines).
    """

    model: "torch.nn.Module"
    train: Sequence[Any]
    loss: Callable[..., "torch.Tensor"]
    evaluate: Callable[["torch.nn.Module"], dict[str, float]]
    shard_modules: list[Any] = field(default_factory=list)
    target: tuple[str, str, float] | None = None
    info: dict[str, Any] = field(default_factory=dict)


def allowed_prefixes() -> tuple[str, ...]:
    """Module prefixes user workloads may be imported from (``TRAINFLOW_WORKLOAD_MODULES``)."""
    raw = os.environ.get("TRAINFLOW_WORKLOAD_MODULES", "trainflow.workloads,workloads")
    return tuple(p.strip() for p in raw.split(",") if p.strip())


def resolve(name: str) -> Callable[["TrainingSpec"], Workload]:
    """Return the ``build`` function of workload ``name``.

    Raises:
        SpecError: unknown built-in, a module outside the allowed prefixes, or an import
            path that does not resolve to a callable.
    """
    path = BUILTINS.get(name, name)
    if ":" not in path:
        raise SpecError("workload", name, f"use one of {', '.join(BUILTINS)} or 'package.module:build'")
    module_name, attr = path.split(":", 1)
    if name not in BUILTINS and not any(
        module_name == p or module_name.startswith(p + ".") for p in allowed_prefixes()
    ):
        raise SpecError(
            "workload",
            name,
            f"module not allowed; add its package to TRAINFLOW_WORKLOAD_MODULES (now {','.join(allowed_prefixes())})",
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise SpecError("workload", name, f"cannot import {module_name!r}: {exc}") from exc
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise SpecError("workload", name, f"{module_name} has no callable {attr!r}")
    return fn


def load_workload(spec: "TrainingSpec") -> Workload:
    """Build the workload of ``spec`` (the model initialised from ``spec.seed``)."""
    import torch

    build = resolve(spec.workload)
    torch.manual_seed(spec.seed)
    workload = build(spec)
    if not isinstance(workload, Workload):
        raise SpecError("workload", spec.workload, "build() must return trainflow.workloads.Workload")
    return workload
