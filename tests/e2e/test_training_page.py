"""The training page on the real embedded stack: the plugin mounted by the api-server,
secured by Airflow's own auth, reading a run trained over REST."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

pytestmark = pytest.mark.e2e
DAG = "train_digits"
RUN = "e2e-page-1"


def get(stack, path: str, headers: dict[str, str] | None = None) -> tuple[int, str]:
    req = urllib.request.Request(stack.url + path, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


@pytest.fixture(scope="module")
def finished(client, run_to_end):
    run_to_end(client, DAG, {"nodes": 2, "steps": 60, "checkpoint_interval": 20, "tenant": "e2e"}, RUN, 600)
    return {"Authorization": f"Bearer {client.token()}"}


def test_the_api_needs_airflow_credentials(stack, client):
    for path in ("/trainflow/api/runs", f"/trainflow/api/runs/e2e/{DAG}/{RUN}", "/trainflow/"):
        assert get(stack, path)[0] == 401, path
        assert get(stack, path, {"Authorization": "Bearer not-a-jwt"})[0] == 403, path


def test_the_finished_run_through_the_api(stack, finished):
    status, body = get(stack, "/trainflow/api/runs?tenant=e2e", finished)
    assert status == 200, body
    row = next(r for r in json.loads(body) if r["run_id"] == RUN)
    assert (row["dag_id"], row["state"], row["step"], row["total_steps"]) == (DAG, "completed", 60, 60)
    assert row["evaluated"] and row["world_size"] == 2

    status, body = get(stack, f"/trainflow/api/runs/e2e/{DAG}/{RUN}", finished)
    assert status == 200, body
    d = json.loads(body)
    assert [r["state"] for r in d["ranks"]] == ["done", "done"]
    assert d["checkpoints"] and all(c["verified"] for c in d["checkpoints"])
    assert d["checkpoints"][0]["step"] == 60 and d["loss_curve"][-1]["step"] == 60
    assert "accuracy" in d["evaluation"]["metrics"]
    assert get(stack, f"/trainflow/api/runs/e2e/{DAG}/nope", finished)[0] == 404


def test_the_page_and_its_place_in_the_ui(stack, client, finished):
    status, page = get(stack, "/trainflow/", finished)
    assert status == 200 and 'const API = "/trainflow/api"' in page
    # The UI's session: the token as the api-server's login sets it, in the _token cookie.
    assert get(stack, "/trainflow/api/runs", {"Cookie": f"_token={client.token()}"})[0] == 200
    plugins = client.call("GET", "/api/v2/plugins")["plugins"]
    mine = next(p for p in plugins if p["name"] == "trainflow_ui")
    assert mine["fastapi_apps"][0]["url_prefix"] == "/trainflow"
    assert mine["external_views"][0]["href"] == "/trainflow/"
