"""The Kubernetes launch path: one pod per node of a gang, built by a pure function.

``build_pod`` turns a plan and a node into a Pod manifest (a plain dict): the chip
family's image, its device-plugin resource requested and limited to the node's ranks,
the visibility and rendezvous environment, node selector and tolerations, a required
node anti-affinity against cordoned hosts and between the gang's own pods, a
memory-backed ``/dev/shm``, the shared workspace volume, and labels naming the DAG, run,
node and try. The pod runs the same node agent as the local launcher. The operator side
(``operators/shard_train.py``) hands the manifest to the cncf-kubernetes provider's
``KubernetesPodOperator``; ``trainflow pods --dry-run`` prints it as YAML.

No Kubernetes API server is reachable here: the manifests are validated offline against
the Kubernetes OpenAPI schemas (``kubernetes-validate``, strict) in the tests.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from typing import Any, Mapping

from trainflow.chips.registry import get_family, propagated_env

# Kubernetes label values: ≤ 63 characters of [A-Za-z0-9_.-], starting and ending alnum.
_LABEL_BAD = re.compile(r"[^A-Za-z0-9_.-]+")
AGENT_COMMAND = ("python", "-u", "-m", "trainflow.launch.agent")
CONTAINER = "node"


def label_value(text: str) -> str:
    """``text`` as a valid label value (hashed when it does not fit)."""
    value = _LABEL_BAD.sub("-", text).strip("-_.")
    if len(value) > 63:
        digest = hashlib.sha256(text.encode()).hexdigest()[:10]
        value = value[:52].rstrip("-_.") + "-" + digest
    return value or "x"


def pod_name(plan: Mapping[str, Any], node: int, try_number: int) -> str:
    """A DNS-1123 name, unique per run, node and try: ``tf-<rdzv hash>-n<node>-t<try>``."""
    rid = plan["rendezvous"]["id"]  # tf-<16 hex>-<attempt>
    return f"{rid}-n{node}-t{try_number}".lower()[:63]


def _home() -> str:
    from trainflow.workspace import default_root

    return str(default_root().parent)


def _json_env(env: Mapping[str, str], key: str, default: Any) -> Any:
    raw = env.get(key)
    if not raw:
        return default
    try:
        return json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{key}={raw!r} is not JSON ({exc}); e.g. {json.dumps(default) or '{}'}") from None


@dataclass(frozen=True)
class PodConfig:
    """Cluster settings of the Kubernetes launcher (``TRAINFLOW_K8S_*`` variables).

    Attributes:
        namespace: where the node pods run.
        image: worker image for every family (empty: the spec's, else the family's).
        image_pull_policy: ``IfNotPresent``, ``Always`` or ``Never``.
        service_account: pod service account (empty: the namespace default).
        node_selector: labels a node must carry (JSON object).
        tolerations: extra tolerations (JSON list); device-resource taints are tolerated.
        resource: device resource to request instead of the family's (a HAMi or vNPU name).
        workspace_claim: PersistentVolumeClaim holding ``workspace_root`` (the run
            directories every node reads and writes); it must be ReadWriteMany.
        workspace_root: where the claim is mounted (the same path Airflow's workers use).
        shm_size: size of the memory-backed ``/dev/shm`` (dataloaders, NCCL/HCCL buffers).
        cpu, memory: container requests (= limits) besides the devices; empty: none.
        grace_s: termination grace: time for the emergency checkpoint on SIGTERM.
    """

    namespace: str = "trainflow"
    image: str = ""
    image_pull_policy: str = "IfNotPresent"
    service_account: str = ""
    node_selector: Mapping[str, str] = field(default_factory=dict)
    tolerations: tuple[Mapping[str, Any], ...] = ()
    resource: str = ""
    workspace_claim: str = "trainflow-workspace"
    workspace_root: str = "/opt/airflow/trainflow"
    shm_size: str = "8Gi"
    cpu: str = ""
    memory: str = ""
    grace_s: int = 30

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "PodConfig":
        env = os.environ if env is None else env
        g = lambda k, d: env.get(f"TRAINFLOW_K8S_{k}", d)  # noqa: E731
        config = cls(
            namespace=g("NAMESPACE", cls.namespace),
            image=g("IMAGE", ""),
            image_pull_policy=g("IMAGE_PULL_POLICY", cls.image_pull_policy),
            service_account=g("SERVICE_ACCOUNT", ""),
            node_selector=_json_env(env, "TRAINFLOW_K8S_NODE_SELECTOR", {}),
            tolerations=tuple(_json_env(env, "TRAINFLOW_K8S_TOLERATIONS", [])),
            resource=g("RESOURCE", ""),
            workspace_claim=g("WORKSPACE_CLAIM", cls.workspace_claim),
            workspace_root=g("WORKSPACE_ROOT", env.get("TRAINFLOW_HOME") or _home()),
            shm_size=g("SHM_SIZE", cls.shm_size),
            cpu=g("CPU", ""),
            memory=g("MEMORY", ""),
            grace_s=int(g("GRACE_S", cls.grace_s)),
        )
        if config.image_pull_policy not in ("IfNotPresent", "Always", "Never"):
            raise ValueError(
                f"TRAINFLOW_K8S_IMAGE_PULL_POLICY={config.image_pull_policy!r}: use IfNotPresent, Always or Never"
            )
        if not isinstance(config.node_selector, dict) or not all(
            isinstance(v, str) for v in config.node_selector.values()
        ):
            raise ValueError("TRAINFLOW_K8S_NODE_SELECTOR must be a JSON object of strings")
        return config


def build_pod(
    plan: Mapping[str, Any],
    node: int,
    *,
    try_number: int = 1,
    cordoned: list[str] | tuple[str, ...] = (),
    config: PodConfig | None = None,
    env: Mapping[str, str] | None = None,
    plan_path: str | None = None,
) -> dict[str, Any]:
    """The Pod manifest of node ``node`` of ``plan`` (pure).

    Args:
        plan: the run's plan (``trainflow.plan.build_plan``).
        node: the slot to launch.
        try_number: the Airflow try (in the name and labels: a retry is a new pod).
        cordoned: hosts (Kubernetes node names) no node of any run may be placed on.
        config: cluster settings (default: ``PodConfig.from_env``).
        env: the launcher's environment, whose family-prefixed variables (NCCL_*, HCCL_*
            ...) every node gets; default ``os.environ``.
        plan_path: where the plan lies in the shared workspace (default:
            ``<run_dir>/plan.json``).
    """
    config = config or PodConfig.from_env(env)
    env = os.environ if env is None else env
    spec = plan["spec"]
    family = get_family(spec["chip"], env)
    nproc = int(spec["nproc_per_node"])
    rdzv = plan["rendezvous"]
    plan_path = plan_path or os.path.join(plan["run_dir"], "plan.json")
    root = config.workspace_root.rstrip("/") + "/"
    if not plan["run_dir"].startswith(root):
        raise ValueError(
            f"run_dir {plan['run_dir']} is not under the workspace volume mounted at "
            f"{config.workspace_root}: every node reads the plan and writes checkpoints "
            f"there; set TRAINFLOW_HOME (or TRAINFLOW_K8S_WORKSPACE_ROOT) to the shared "
            f"claim's mount path on the Airflow workers too"
        )
    labels = {
        "app.kubernetes.io/name": "trainflow",
        "app.kubernetes.io/component": "node",
        "trainflow.io/dag": label_value(plan["dag_id"]),
        "trainflow.io/run": label_value(plan["run_id"]),
        "trainflow.io/tenant": label_value(plan.get("tenant", "default")),
        "trainflow.io/node": str(node),
        "trainflow.io/try": str(try_number),
        "trainflow.io/chip": family.name,
        "trainflow.io/queue": label_value(plan["queue"]),
        "trainflow.io/gang": label_value(rdzv["id"]),
    }
    variables = {
        **propagated_env(family, env),
        **{k: v for k, v in family.default_env.items()},
        **plan.get("env", {}),
        "TRAINFLOW_HOME": config.workspace_root,
        "TRAINFLOW_NODE": str(node),
        "TRAINFLOW_PLAN": plan_path,
        "TRAINFLOW_RDZV_BACKEND": rdzv["backend"],
        "TRAINFLOW_RDZV_ENDPOINT": rdzv["endpoint"],
        "TRAINFLOW_RDZV_ID": rdzv["id"],
        "TRAINFLOW_DAG_ID": plan["dag_id"],
        "TRAINFLOW_RUN_ID": plan["run_id"],
        "PYTHONUNBUFFERED": "1",
    }
    if family.has_devices:
        # The device plugin mounts exactly the requested devices, re-indexed from 0; each
        # worker takes its share of them (``registry.worker_env``).
        variables["TRAINFLOW_NODE_DEVICES"] = str(nproc)
    container_env = [{"name": k, "value": str(v)} for k, v in sorted(variables.items())]
    # The registry's host is the Kubernetes node: cordons and failure counts follow it.
    container_env.append({"name": "TRAINFLOW_HOST", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}})
    container_env.append({"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}})
    resources: dict[str, dict[str, str]] = {"requests": {}, "limits": {}}
    device_resource = config.resource or family.k8s_resource
    if family.has_devices and device_resource:
        resources["requests"][device_resource] = str(nproc)
        resources["limits"][device_resource] = str(nproc)
    for name, value in (("cpu", config.cpu), ("memory", config.memory)):
        if value:
            resources["requests"][name] = value
            resources["limits"][name] = value
    tolerations = [dict(t) for t in config.tolerations]
    if family.has_devices and device_resource:
        tolerations.append({"key": device_resource, "operator": "Exists", "effect": "NoSchedule"})
    affinity: dict[str, Any] = {
        # One node of a gang per host: members and spares never share a machine.
        "podAntiAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": [
                {
                    "labelSelector": {"matchLabels": {"trainflow.io/gang": labels["trainflow.io/gang"]}},
                    "topologyKey": "kubernetes.io/hostname",
                }
            ]
        },
    }
    if cordoned:
        affinity["nodeAffinity"] = {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {
                        "matchExpressions": [
                            {
                                "key": "kubernetes.io/hostname",
                                "operator": "NotIn",
                                "values": sorted(set(cordoned)),
                            }
                        ]
                    }
                ],
            }
        }
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",  # Airflow's retry replaces a failed node, as on hosts
        "terminationGracePeriodSeconds": config.grace_s,
        "containers": [
            {
                "name": CONTAINER,
                "image": config.image or spec.get("image") or family.image,
                "imagePullPolicy": config.image_pull_policy,
                "command": [
                    *AGENT_COMMAND,
                    "--plan",
                    plan_path,
                    "--node",
                    str(node),
                    "--preflight-try",
                    str(try_number),
                ],
                "env": container_env,
                "resources": resources,
                "volumeMounts": [
                    {"name": "dshm", "mountPath": "/dev/shm"},
                    {"name": "workspace", "mountPath": config.workspace_root},
                ],
            }
        ],
        "volumes": [
            {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": config.shm_size}},
            {"name": "workspace", "persistentVolumeClaim": {"claimName": config.workspace_claim}},
        ],
        "affinity": affinity,
        "tolerations": tolerations,
    }
    if config.node_selector:
        pod_spec["nodeSelector"] = dict(config.node_selector)
    if config.service_account:
        pod_spec["serviceAccountName"] = config.service_account
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": pod_name(plan, node, try_number),
            "namespace": config.namespace,
            "labels": labels,
            "annotations": {
                "trainflow.io/dag-id": plan["dag_id"],
                "trainflow.io/run-id": plan["run_id"],
                "trainflow.io/plan": plan_path,
            },
        },
        "spec": pod_spec,
    }


def to_yaml(manifests: list[dict[str, Any]]) -> str:
    import yaml

    return yaml.safe_dump_all(manifests, sort_keys=False)
