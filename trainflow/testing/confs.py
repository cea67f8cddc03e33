"""Run confs the end-to-end tests share (one clean reference per conf in a session)."""

from __future__ import annotations

# A 300-step digits run that a fault can hit mid-run: a checkpoint every 50 steps, a watch
# that judges fast. heartbeat_timeout must exceed a worker restart (python + import torch +
# rendezvous), or a process fault that torch elastic heals inside the node looks like a
# hang: ~4 s on a quiet 2-core machine, far more under load.
FAULT_RUN = {
    "steps": 300,
    "checkpoint_interval": 50,
    "heartbeat_interval": 0.5,
    "heartbeat_timeout": 8.0,
    "startup_timeout": 120.0,
    "seed": 11,
}
