"""docker/helm/values.yaml: values for the official Apache Airflow Helm chart, generated from
the chip registry. No Helm binary or chart is available offline, so the chart itself is not
rendered here; what the values decide is checked: the file is the generator's output, every
worker set's queue is a real chip queue with the registry's device resource, and each set's
pod part validates against the Kubernetes schemas in strict mode."""

from __future__ import annotations

from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from trainflow.chips.registry import family_of_queue, get_family, queue_for
from trainflow.cli import main
from trainflow.launch import helm

VALUES = Path(__file__).resolve().parents[2] / "docker" / "helm" / "values.yaml"
K8S_VERSION = "1.37.0"


def _committed() -> dict:
    return yaml.safe_load(VALUES.read_text())


def test_the_committed_values_are_the_generators_output(capsys):
    assert main(["helm-values"]) == 0
    assert capsys.readouterr().out == VALUES.read_text(), "run: trainflow helm-values > docker/helm/values.yaml"


def test_celery_executor_one_set_per_chip_queue_and_a_control_set():
    values = _committed()
    assert values["executor"] == "CeleryExecutor"
    assert values["config"]["celery_broker_transport_options"]["visibility_timeout"] >= 7 * 24 * 3600
    sets = values["workers"]["celery"]["sets"]
    assert values["workers"]["celery"]["enableDefault"] is False
    assert [s["queue"] for s in sets if s["name"] == "control"] == ["default"]
    chips = [s for s in sets if s["name"] != "control"]
    assert {s["queue"] for s in chips} == {queue_for(f) for f in helm.DEFAULT_FAMILIES}
    for s in chips:
        family = get_family(family_of_queue(s["queue"]))
        assert s["nodeSelector"] == {helm.QUEUE_LABEL: s["queue"]}
        env = {e["name"]: e.get("value") for e in s["env"]}
        assert env["AIRFLOW__CELERY__WORKER_CONCURRENCY"] == "1"  # a node task owns its host's chips
        if family.k8s_resource:
            assert set(s["resources"]["limits"]) == {family.k8s_resource}
            assert s["tolerations"][0]["key"] == family.k8s_resource


def test_the_image_is_pinned_and_credentials_come_from_secrets():
    values = _committed()
    assert values["images"]["airflow"]["tag"] not in ("", "latest")
    text = VALUES.read_text().lower()
    assert "password" not in text and "aws_secret" not in text
    assert {s["envName"] for s in values["secret"]} == {"TRAINFLOW_STATE_DB", "AIRFLOW_CONN_TRAINFLOW_S3"}


@pytest.mark.parametrize("name", [s["name"] for s in yaml.safe_load(VALUES.read_text())["workers"]["celery"]["sets"]])
def test_every_worker_set_pod_validates_strictly(name):
    values = _committed()
    worker = next(s for s in values["workers"]["celery"]["sets"] if s["name"] == name)
    kubernetes_validate.validate(helm.set_pod(values, worker), desired_version=K8S_VERSION, strict=True)


def test_a_misspelt_field_fails_validation_so_these_tests_can_fail():
    values = _committed()
    worker = dict(values["workers"]["celery"]["sets"][2], nodeSelecter={"x": "y"})
    pod = helm.set_pod(values, worker)
    pod["spec"]["nodeSelecter"] = {"x": "y"}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(pod, desired_version=K8S_VERSION, strict=True)
