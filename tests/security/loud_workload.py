"""Hostile workloads for the payload-bound tests (the digits workload, made to misbehave)."""

from __future__ import annotations

import dataclasses

from trainflow.workloads.digits import build as digits

HUGE = 1_000_000  # characters of the exception message a loud workload raises


def loud(spec):
    """Raises a ValueError with a 1 MB message from its loss at the first step."""

    def loss(model, batch):
        raise ValueError("x" * HUGE)

    return dataclasses.replace(digits(spec), loss=loss)


def bad_metrics(spec):
    """Trains like digits; its evaluate returns a list as a metric value."""
    return dataclasses.replace(
        digits(spec), evaluate=lambda model: {"accuracy": 0.9, "confusion": [[1, 2]] * 1000}, target=None
    )
