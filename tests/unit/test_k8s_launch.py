"""``launcher: kubernetes`` through the cncf-kubernetes provider, against a fake Kubernetes
API server (``trainflow.testing.fake_k8s``: there is no cluster here). ShardTrainOperator
submits the pod trainflow built, the provider streams its log from the ``node`` container,
deletes it when it succeeded and keeps a failed one for inspection."""

from __future__ import annotations

import json
from types import SimpleNamespace

import kubernetes_validate
import pytest

from trainflow.plan import build_plan
from trainflow.spec import TrainingSpec
from trainflow.testing.fake_k8s import FakeKubernetesAPI


@pytest.fixture
def cluster(tmp_path, monkeypatch):
    def start(exit_code: int = 0) -> FakeKubernetesAPI:
        api = FakeKubernetesAPI(exit_code=exit_code).__enter__()
        config = api.kubeconfig(tmp_path / "kubeconfig")
        monkeypatch.setenv(
            "AIRFLOW_CONN_KUBERNETES_DEFAULT",
            json.dumps({"conn_type": "kubernetes", "extra": {"kube_config_path": str(config), "in_cluster": False}}),
        )
        started.append(api)
        return api

    started: list[FakeKubernetesAPI] = []
    monkeypatch.setenv("TRAINFLOW_HOME", str(tmp_path / "home"))
    yield start
    for api in started:
        api.__exit__(None, None, None)


def _run_node(tmp_path, node: int = 1):
    from operators.shard_train import ShardTrainOperator

    spec = TrainingSpec.from_mapping({"chip": "ascend", "nodes": 2, "nproc_per_node": 8, "launcher": "kubernetes"})
    run_dir = tmp_path / "home" / "runs" / "default" / "train_digits" / "r1"
    plan = build_plan(
        spec,
        dag_id="train_digits",
        run_id="r1",
        run_dir=str(run_dir),
        rdzv_endpoint="trainflow-rdzv:29400",
        rdzv_backend="c10d",
    )
    op = ShardTrainOperator(task_id="shard_train", node=node, plan_path=str(run_dir / "plan.json"))
    pushed = {}
    ti = SimpleNamespace(
        dag_id="train_digits",
        task_id="shard_train",
        map_index=node,
        try_number=2,
        xcom_push=lambda key, value: pushed.__setitem__(key, value),
    )
    return op._run_pod({"ti": ti, "run_id": "r1", "dag": object(), "task": op}, plan, node, 2), pushed


@pytest.mark.integration  # real worker processes
def test_a_node_runs_as_a_pod_to_its_end(tmp_path, cluster):
    from trainflow.cluster.hosts import HostRegistry

    api = cluster(exit_code=0)
    HostRegistry().cordon("gpu-node-7", reason="ECC errors")
    out, pushed = _run_node(tmp_path)
    (created,) = [body for verb, _, body in api.calls if verb == "POST"]
    assert created["metadata"]["name"] == out["pod"] == pushed["pod_name"]
    (term,) = created["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"
    ]
    assert term["matchExpressions"][0]["values"] == ["gpu-node-7"]  # the cordoned host is avoided
    assert (
        created["metadata"]["labels"]["trainflow.io/node"] == "1"
        and created["metadata"]["labels"]["trainflow.io/try"] == "2"
    )
    (container,) = created["spec"]["containers"]
    assert container["name"] == "node" and container["resources"]["limits"] == {"huawei.com/Ascend910": "8"}
    assert container["command"][-4:] == ["--node", "1", "--preflight-try", "2"]
    kubernetes_validate.validate(created, desired_version="1.37.0", strict=True)
    assert any(verb == "GET" and path.endswith("/log") and "container=node" in query for verb, path, query in api.calls)
    assert [verb for verb, *_ in api.calls].count("DELETE") == 1 and not api.pods  # succeeded: deleted


@pytest.mark.integration  # real worker processes
def test_a_failed_pod_fails_the_node_task_and_is_kept(tmp_path, cluster):
    from airflow.sdk.exceptions import AirflowException

    api = cluster(exit_code=75)  # the pod's preflight failed: Airflow's retry makes a new pod
    with pytest.raises(AirflowException, match="Pod .* returned a failure"):
        _run_node(tmp_path)
    assert "DELETE" not in [verb for verb, *_ in api.calls] and len(api.pods) == 1
