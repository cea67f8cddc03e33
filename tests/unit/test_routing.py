from __future__ import annotations

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest

from trainflow.routing import node_queue

HOOK = Path(__file__).resolve().parents[2] / "plugins" / "airflow_local_settings.py"


@pytest.mark.parametrize(
    "task, conf, queue",
    [
        ("shard_train", {"chip": "ascend"}, "ascend-910b"),
        ("shard_train", {"chip": "nvidia"}, "nvidia-gpu"),
        ("shard_train", {"chip": "cpu"}, "cpu"),
        ("shard_train", {}, None),
        ("shard_train", None, None),
        ("shard_train", {"chip": "tpu"}, None),
        ("provision", {"chip": "ascend"}, None),
    ],
)
def test_node_queue(task, conf, queue):
    assert node_queue(task, conf) == queue


def test_mutation_hook_sets_the_queue_from_the_run_conf():
    spec = importlib.util.spec_from_file_location("airflow_local_settings_under_test", HOOK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    ti = SimpleNamespace(task_id="shard_train", queue="cpu", map_index=1)
    module.task_instance_mutation_hook(ti, SimpleNamespace(conf={"chip": "cambricon"}))
    assert ti.queue == "cambricon-mlu"
    other = SimpleNamespace(task_id="evaluate", queue="default")
    module.task_instance_mutation_hook(other, SimpleNamespace(conf={"chip": "cambricon"}))
    assert other.queue == "default"
