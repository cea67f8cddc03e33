"""A real embedded stack (api-server, scheduler, dag-processor, triggerer) per test module."""

from __future__ import annotations

import pytest

from trainflow.launch.local import free_port
from trainflow.stack import EmbeddedStack


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    root = tmp_path_factory.mktemp("stack")
    s = EmbeddedStack(home=root / "airflow", trainflow_home=root / "trainflow", port=free_port())
    try:
        s.up(timeout=240)
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def client(stack):
    return stack.client()
