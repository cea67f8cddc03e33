"""The Kubernetes launch path's Airflow side: a node's pod (``trainflow.launch.k8s``)
handed to the cncf-kubernetes provider's ``KubernetesPodOperator``, which creates it,
streams its log into the task's and deletes it when it succeeded."""

from __future__ import annotations

import os
from typing import Any, Mapping


def pod_operator(
    pod: Mapping[str, Any], *, task_id: str, startup_timeout_s: int = 300, env: Mapping[str, str] | None = None
):
    """A ``KubernetesPodOperator`` that submits exactly ``pod``.

    Connection: ``TRAINFLOW_K8S_CONN_ID`` (default ``kubernetes_default``); in a cluster
    set ``TRAINFLOW_K8S_IN_CLUSTER=1``.
    """
    from airflow.providers.cncf.kubernetes.operators.pod import KubernetesPodOperator

    env = os.environ if env is None else env
    in_cluster = env.get("TRAINFLOW_K8S_IN_CLUSTER")
    return KubernetesPodOperator(
        task_id=task_id,
        pod_template_dict=dict(pod),
        name=pod["metadata"]["name"],
        namespace=pod["metadata"]["namespace"],
        random_name_suffix=False,
        base_container_name=pod["spec"]["containers"][0]["name"],
        kubernetes_conn_id=env.get("TRAINFLOW_K8S_CONN_ID", "kubernetes_default"),
        in_cluster=None if in_cluster is None else in_cluster.lower() in ("1", "true", "yes"),
        get_logs=True,
        do_xcom_push=False,
        startup_timeout_seconds=startup_timeout_s,
        on_finish_action="delete_succeeded_pod",
        reattach_on_restart=False,
    )
