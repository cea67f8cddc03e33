from __future__ import annotations

import pytest

from trainflow.launch.local import kill_tree


@pytest.fixture
def agents():
    """Node agents a test starts (appended to this list); their trees are killed and the
    agents reaped at the end."""
    procs = []
    yield procs
    for p in procs:
        if p.poll() is None:
            kill_tree(p)
        p.wait()
