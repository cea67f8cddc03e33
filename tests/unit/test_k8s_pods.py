"""The Kubernetes launch path, offline: a pod for every chip family, validated against the
Kubernetes OpenAPI schemas in strict mode (kubernetes-validate), both as trainflow builds
it and as the cncf-kubernetes provider's KubernetesPodOperator would submit it. There is
no API server here: nothing is applied to a cluster."""

from __future__ import annotations

import copy
import subprocess
import sys

import kubernetes_validate
import pytest
import yaml

from trainflow.chips.registry import FAMILIES, get_family
from trainflow.launch.k8s import PodConfig, build_pod, label_value
from trainflow.plan import build_plan
from trainflow.spec import TrainingSpec

K8S_VERSION = "1.37.0"
ROOT = "/mnt/trainflow"


def _plan(chip: str, *, nodes=2, nproc=2, spares=0, run_id="manual__2026-12-03T09:00:00+00:00", **extra):
    spec = TrainingSpec.from_mapping(
        {"chip": chip, "nodes": nodes, "nproc_per_node": nproc, "spares": spares, "launcher": "kubernetes", **extra}
    )
    return build_plan(
        spec,
        dag_id="train_digits",
        run_id=run_id,
        run_dir=f"{ROOT}/runs/default/train_digits/{run_id}",
        rdzv_endpoint="trainflow-rdzv.trainflow.svc:29400",
        rdzv_backend="c10d",
    )


CONFIG = PodConfig(
    workspace_root=ROOT,
    node_selector={"pool": "training"},
    tolerations=({"key": "dedicated", "operator": "Equal", "value": "train", "effect": "NoSchedule"},),
    cpu="8",
    memory="64Gi",
)


def validate(manifest: dict) -> None:
    kubernetes_validate.validate(manifest, desired_version=K8S_VERSION, strict=True)


@pytest.mark.parametrize("chip", sorted(FAMILIES))
def test_every_family_gets_a_valid_pod(chip):
    plan = _plan(chip)
    family = get_family(chip, env={})
    pod = build_pod(plan, 1, try_number=3, cordoned=["node-7", "node-3"], config=CONFIG, env={})
    validate(pod)
    meta, spec = pod["metadata"], pod["spec"]
    assert meta["name"] == f"{plan['rendezvous']['id']}-n1-t3" and len(meta["name"]) <= 63
    assert meta["labels"]["trainflow.io/node"] == "1" and meta["labels"]["trainflow.io/try"] == "3"
    assert meta["labels"]["trainflow.io/dag"] == "train_digits"
    assert meta["annotations"]["trainflow.io/run-id"] == plan["run_id"]
    (c,) = spec["containers"]
    assert c["image"] == family.image
    assert c["command"][-6:] == ["--plan", f"{plan['run_dir']}/plan.json", "--node", "1", "--preflight-try", "3"]
    env = {e["name"]: e.get("value", e.get("valueFrom")) for e in c["env"]}
    assert env["TRAINFLOW_NODE"] == "1" and env["TRAINFLOW_RDZV_ENDPOINT"] == "trainflow-rdzv.trainflow.svc:29400"
    assert env["TRAINFLOW_HOST"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    for key, value in family.default_env.items():
        assert env[key] == value
    if family.has_devices:
        assert c["resources"]["limits"][family.k8s_resource] == "2"
        assert c["resources"]["requests"][family.k8s_resource] == "2"
        assert env["TRAINFLOW_NODE_DEVICES"] == "2"
        assert {"key": family.k8s_resource, "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
    else:
        assert set(c["resources"]["limits"]) == {"cpu", "memory"}
    assert spec["nodeSelector"] == {"pool": "training"}
    (term,) = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert term["matchExpressions"] == [
        {"key": "kubernetes.io/hostname", "operator": "NotIn", "values": ["node-3", "node-7"]}
    ]
    anti = spec["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][0]
    assert anti["labelSelector"]["matchLabels"] == {"trainflow.io/gang": plan["rendezvous"]["id"]}
    shm = next(v for v in spec["volumes"] if v["name"] == "dshm")
    assert shm["emptyDir"]["medium"] == "Memory"
    assert {"name": "workspace", "mountPath": ROOT} in c["volumeMounts"]


def test_the_validator_is_strict_so_these_tests_can_fail():
    pod = build_pod(_plan("nvidia"), 0, config=CONFIG, env={})
    bad = copy.deepcopy(pod)
    bad["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] = 2  # a number, not a quantity string: fine
    validate(bad)
    for mutate in (
        lambda p: p["spec"].__setitem__("restartPolicy", 7),
        lambda p: p["spec"]["containers"][0].__setitem__("imagePullPolicies", "Always"),
        lambda p: p["spec"]["containers"][0]["env"].append({"name": "X", "value": 5}),
        lambda p: p["spec"]["volumes"][0].__setitem__("emptyDir", {"medium": "Memory", "size": "1Gi"}),
    ):
        bad = copy.deepcopy(pod)
        mutate(bad)
        with pytest.raises(kubernetes_validate.ValidationError):
            validate(bad)


def test_no_cordons_no_node_affinity_and_hami_resources_by_configuration():
    config = PodConfig(workspace_root=ROOT, resource="nvidia.com/gpumem")
    pod = build_pod(_plan("nvidia"), 0, config=config, env={"NCCL_SOCKET_IFNAME": "eth0", "HOME": "/x"})
    validate(pod)
    assert "nodeAffinity" not in pod["spec"]["affinity"]
    c = pod["spec"]["containers"][0]
    assert c["resources"]["limits"] == {"nvidia.com/gpumem": "2"}
    names = {e["name"] for e in c["env"]}
    assert "NCCL_SOCKET_IFNAME" in names and "HOME" not in names


def test_spares_get_pods_and_long_run_ids_still_make_valid_labels():
    run_id = "scheduled__2026-12-03T09:00:00+00:00" + "-very-long-suffix" * 5
    plan = _plan("ascend", nodes="2:3", spares=1, run_id=run_id, shrink_grace=10, heartbeat_timeout=30)
    pods = [build_pod(plan, i, config=CONFIG, env={}) for i in range(len(plan["nodes"]))]
    assert len(pods) == 4
    for pod in pods:
        validate(pod)
        assert len(pod["metadata"]["labels"]["trainflow.io/run"]) <= 63
    assert len({p["metadata"]["name"] for p in pods}) == 4
    assert label_value("a" * 100) != label_value("a" * 101)


def test_spec_image_and_config_image():
    plan = _plan("cambricon", image="registry.local/ml/worker-mlu:2.1")
    assert (
        build_pod(plan, 0, config=CONFIG, env={})["spec"]["containers"][0]["image"]
        == "registry.local/ml/worker-mlu:2.1"
    )
    config = PodConfig(workspace_root=ROOT, image="mirror.local/trainflow:all")
    assert build_pod(plan, 0, config=config, env={})["spec"]["containers"][0]["image"] == "mirror.local/trainflow:all"


def test_a_run_dir_outside_the_workspace_volume_is_refused():
    with pytest.raises(ValueError, match="is not under the workspace volume mounted at /elsewhere"):
        build_pod(_plan("nvidia"), 0, config=PodConfig(workspace_root="/elsewhere"), env={})


def test_pod_config_from_env():
    config = PodConfig.from_env(
        {
            "TRAINFLOW_K8S_NAMESPACE": "ml",
            "TRAINFLOW_K8S_NODE_SELECTOR": '{"a": "b"}',
            "TRAINFLOW_HOME": "/shared",
            "TRAINFLOW_K8S_TOLERATIONS": "[]",
        }
    )
    assert (config.namespace, config.node_selector, config.workspace_root) == ("ml", {"a": "b"}, "/shared")
    with pytest.raises(ValueError, match="TRAINFLOW_K8S_NODE_SELECTOR='nope' is not JSON"):
        PodConfig.from_env({"TRAINFLOW_K8S_NODE_SELECTOR": "nope"})
    with pytest.raises(ValueError, match="IMAGE_PULL_POLICY='Sometimes'"):
        PodConfig.from_env({"TRAINFLOW_K8S_IMAGE_PULL_POLICY": "Sometimes"})


@pytest.mark.parametrize("chip", ["nvidia", "ascend", "cpu"])
def test_the_provider_submits_the_same_valid_pod(chip):
    """What KubernetesPodOperator would send (its dry-run build, no cluster needed)."""
    from kubernetes.client import ApiClient

    from operators._k8s import pod_operator

    pod = build_pod(_plan(chip), 1, try_number=2, cordoned=["bad-host"], config=CONFIG, env={})
    op = pod_operator(pod, task_id="shard_train_pod", env={})
    built = ApiClient().sanitize_for_serialization(op.build_pod_request_obj(dry_run=True))
    validate(built)
    assert built["metadata"]["name"] == pod["metadata"]["name"]
    assert built["metadata"]["namespace"] == "trainflow"
    assert built["spec"]["restartPolicy"] == "Never"
    (c,) = built["spec"]["containers"]
    assert c["name"] == "node" and c["command"] == pod["spec"]["containers"][0]["command"]
    assert c["resources"] == pod["spec"]["containers"][0]["resources"]
    assert built["spec"]["affinity"] == pod["spec"]["affinity"]
    assert set(pod["metadata"]["labels"].items()) <= set(built["metadata"]["labels"].items())


def test_dry_run_cli_prints_yaml_of_every_slot(tmp_path):
    spec = tmp_path / "spec.json"
    spec.write_text('{"chip": "ascend", "nodes": 2, "spares": 1, "nproc_per_node": 8, "launcher": "kubernetes"}')
    env = {"PATH": "/usr/bin:/bin", "TRAINFLOW_HOME": str(tmp_path / "home"), "HOME": str(tmp_path)}
    out = subprocess.run(
        [sys.executable, "-m", "trainflow.cli", "pods", str(spec)], capture_output=True, text=True, env=env, check=True
    ).stdout
    pods = list(yaml.safe_load_all(out))
    assert [p["metadata"]["labels"]["trainflow.io/node"] for p in pods] == ["0", "1", "2"]
    for pod in pods:
        validate(pod)
        assert pod["spec"]["containers"][0]["resources"]["limits"] == {"huawei.com/Ascend910": "8"}
    bad = subprocess.run(
        [sys.executable, "-m", "trainflow.cli", "pods", str(spec), "--node", "5"],
        capture_output=True,
        text=True,
        env=env,
    )
    assert bad.returncode == 2 and "--node" in bad.stderr and "slots 0..2" in bad.stderr
