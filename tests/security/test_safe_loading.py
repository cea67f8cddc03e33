"""Checkpoints load without running code from them: DCP's ``.metadata`` is unpickled with
an allowlist of DCP's own classes, non-tensor items with ``torch.load(weights_only=True)``;
a checkpoint whose manifest does not verify is never chosen for loading."""

from __future__ import annotations

import os
import pickle

import pytest
import torch

from trainflow.checkpoint import dcp, manifest
from trainflow.errors import CheckpointError

pytestmark = pytest.mark.integration  # real processes / a gloo world


class Boom:
    """Pickles as a call of ``os.system`` (what a crafted checkpoint would carry)."""

    def __init__(self, marker) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _save(root, model, step=10):
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.ones(1, 4)).sum().backward()
    optimizer.step()
    dcp.save(model, optimizer, root=root, step=step, world_size=1, training_hash="h", keep_last=3)
    dcp.wait_for_prune()
    return manifest.step_dir(root, step)


@pytest.fixture
def gloo_world():
    import torch.distributed as dist

    from trainflow.launch.local import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_a_real_checkpoint_loads_through_the_safe_path(tmp_path, gloo_world):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    path = _save(tmp_path, model)
    other = torch.nn.Linear(4, 2)
    dcp.load_model_only(other, str(path))
    assert dcp.weights_digest(other) == dcp.weights_digest(model)


def test_metadata_that_names_any_other_global_is_refused_before_it_runs(tmp_path, gloo_world):
    marker = tmp_path / "pwned"
    path = _save(tmp_path / "ckpt", torch.nn.Linear(4, 2))
    (path / ".metadata").write_bytes(pickle.dumps(Boom(marker)))
    with pytest.raises(CheckpointError, match=r"names (posix|os)\.system, which a DCP checkpoint never does"):
        dcp.load_model_only(torch.nn.Linear(4, 2), str(path))
    assert not marker.exists()
    with open(path / ".metadata", "rb") as fh, pytest.raises(CheckpointError):
        dcp.safe_metadata(fh)
    assert not marker.exists()


def test_a_tampered_checkpoint_never_verifies_so_it_is_never_chosen(tmp_path, gloo_world):
    path = _save(tmp_path, torch.nn.Linear(4, 2))
    (path / ".metadata").write_bytes(pickle.dumps(Boom(tmp_path / "x")))
    assert manifest.verify(path) is None
    assert manifest.newest_verified(tmp_path) is None


def test_non_tensor_items_load_with_weights_only():
    import io

    planner = dcp._safe_planner()
    buf = io.BytesIO()
    torch.save(Boom("/nonexistent/marker"), buf)
    buf.seek(0)
    with pytest.raises(pickle.UnpicklingError):
        torch.load(buf, weights_only=True)  # what the planner's load_bytes calls
    assert type(planner).load_bytes is not type(planner).__mro__[1].load_bytes
