"""The training page's FastAPI app (``plugins/trainflow_ui.py``) with Airflow's real auth.

Airflow's security dependencies check the JWT against the metadata database (revoked
tokens) and look up a DAG's team there, so the module gets a real SQLite metadata database
created from Airflow's models, the SimpleAuthManager, and tokens signed the way
``POST /auth/token`` signs them. Nothing is mocked.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from trainflow import timeline
from trainflow.heartbeat import HeartbeatWriter, RankState
from trainflow.plan import build_plan
from trainflow.spec import TrainingSpec
from trainflow.workspace import Workspace, write_json_atomic

PLUGINS = Path(__file__).resolve().parents[2] / "plugins"
RUN = "manual__2026-12-02T13:05:54+00:00"  # a run id as Airflow makes them
SECRET = "trainflow-ui-test-" + "s" * 48
XSS = "<img src=x onerror=alert(1)>"


def _reset_airflow_auth() -> None:
    from airflow.api_fastapi.app import _AuthManagerState
    from airflow.api_fastapi.auth.managers.base_auth_manager import BaseAuthManager

    _AuthManagerState.instance = None
    # Both cache the secret of the configuration they were first built with.
    BaseAuthManager._get_token_validator.__func__.cache_clear()
    BaseAuthManager._get_token_signer.__func__.cache_clear()


@pytest.fixture(scope="module")
def airflow_auth(tmp_path_factory):
    """Airflow configured for this module: a fresh metadata DB, SimpleAuthManager users
    ``admin`` and ``viewer``, a known JWT secret. Restored afterwards."""
    home = tmp_path_factory.mktemp("airflow")
    reconfigure = "airflow.settings" in sys.modules  # else the import below configures it
    with pytest.MonkeyPatch.context() as mp:
        for key, value in {
            "AIRFLOW_HOME": str(home),
            "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{home}/airflow.db",
            "AIRFLOW__CORE__AUTH_MANAGER": "airflow.api_fastapi.auth.managers.simple.simple_auth_manager.SimpleAuthManager",
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": "admin:admin,viewer:viewer",
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS": "False",
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": str(home / "passwords.json"),
            "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
            "AIRFLOW__API_AUTH__JWT_SECRET": SECRET,
        }.items():
            mp.setenv(key, value)
        from airflow import settings
        from airflow.api_fastapi.app import init_auth_manager
        from airflow.models import import_all_models
        from airflow.models.base import Base

        if reconfigure:
            settings.configure_vars()
            settings.reconfigure_orm()
        import_all_models()
        Base.metadata.create_all(settings.engine)
        _reset_airflow_auth()
        manager = init_auth_manager()
        try:
            yield manager
        finally:
            _reset_airflow_auth()
            if reconfigure:
                mp.undo()
                settings.configure_vars()
                settings.reconfigure_orm()


def token(manager, role: str = "viewer", **kw) -> str:
    from airflow.api_fastapi.auth.managers.simple.user import SimpleAuthManagerUser

    return manager.generate_jwt(SimpleAuthManagerUser(username=role, role=role), **kw)


@pytest.fixture(scope="module")
def ui():
    sys.path.insert(0, str(PLUGINS))  # as Airflow loads the plugins folder
    try:
        import trainflow_ui
    finally:
        sys.path.remove(str(PLUGINS))
    return trainflow_ui


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    """TRAINFLOW_HOME with one running 2-rank run of train_digits."""
    home = tmp_path_factory.mktemp("trainflow")
    spec = TrainingSpec(nodes=2, steps=60, checkpoint_interval=20)
    ws = Workspace(home / "runs", "default", "train_digits", RUN).create()
    write_json_atomic(ws.spec_file, spec.to_dict())
    write_json_atomic(
        ws.plan_file,
        build_plan(spec, dag_id="train_digits", run_id=RUN, run_dir=str(ws.dir), rdzv_endpoint="sqlite:///x"),
    )
    # A stall the gang has healed from (every rank progressed after it); its message carries
    # user text.
    timeline.record(ws.dir, "stall_detected", ranks=[1], message=XSS, time=time.time() - 30)
    for rank in (0, 1):
        HeartbeatWriter(ws.heartbeats, rank=rank, node=rank, interval=1, world=2).beat(
            step=10 + rank, total=60, state=RankState.TRAINING, loss=0.7, samples_per_s=500.0, force=True
        )
    for step, loss in ((1, 2.3), (10, 0.7)):
        timeline.append(ws.dir / "curve.jsonl", {"time": 1.0, "step": step, "loss": loss})
    return home


@pytest.fixture
def client(airflow_auth, ui, home, monkeypatch):
    from fastapi.testclient import TestClient

    monkeypatch.setenv("TRAINFLOW_HOME", str(home))
    with TestClient(ui.create_app()) as c:
        yield c


@pytest.fixture
def auth(airflow_auth):
    return {"Authorization": f"Bearer {token(airflow_auth)}"}


DETAIL = f"/api/runs/default/train_digits/{RUN}"
ROUTES = ["/api/runs", DETAIL, "/"]


@pytest.mark.parametrize("path", ROUTES, ids=["list", "detail", "page"])
def test_without_credentials_every_route_is_401(client, path):
    r = client.get(path)
    assert r.status_code == 401 and r.json() == {"detail": "Not authenticated"}


def test_a_browser_without_a_session_gets_401_with_a_sign_in_link(client):
    r = client.get("/", headers={"Accept": "text/html,application/xhtml+xml"})
    assert r.status_code == 401 and r.headers["content-type"].startswith("text/html")
    assert 'href="/auth/login?next=http%3A%2F%2Ftestserver%2F"' in r.text
    assert client.get("/api/runs", headers={"Accept": "text/html"}).json() == {"detail": "Not authenticated"}


@pytest.mark.parametrize("path", ROUTES, ids=["list", "detail", "page"])
def test_a_token_signed_with_another_secret_is_403(client, airflow_auth, path):
    from airflow.api_fastapi.auth.managers.simple.user import SimpleAuthManagerUser
    from airflow.api_fastapi.auth.tokens import JWTGenerator

    claims = airflow_auth.serialize_user(SimpleAuthManagerUser(username="admin", role="admin"))
    forged = JWTGenerator(
        secret_key="an-attacker-secret-" + "x" * 48, valid_for=3600, audience=airflow_auth._get_jwt_audience()
    ).generate(claims)
    r = client.get(path, headers={"Authorization": f"Bearer {forged}"})
    assert r.status_code == 403 and r.json() == {"detail": "Invalid JWT token"}
    assert client.get(path, headers={"Authorization": "Bearer not-a-jwt"}).status_code == 403


def test_an_expired_token_is_401(client, airflow_auth):
    old = token(airflow_auth, expiration_time_in_seconds=-3600)
    r = client.get("/api/runs", headers={"Authorization": f"Bearer {old}"})
    assert r.status_code == 401 and r.json() == {"detail": "Token Expired"}


def test_runs_with_a_token(client, auth):
    r = client.get("/api/runs", headers=auth)
    assert r.status_code == 200
    [row] = r.json()
    assert (row["tenant"], row["dag_id"], row["run_id"], row["state"]) == ("default", "train_digits", RUN, "running")
    assert (row["step"], row["total_steps"], row["world_size"], row["samples_per_s"]) == (10, 60, 2, 1000.0)
    assert client.get("/api/runs?dag_id=train_tinylm", headers=auth).json() == []


def test_the_ui_session_cookie_is_accepted(client, airflow_auth):
    client.cookies.set("_token", token(airflow_auth))
    assert client.get("/api/runs").status_code == 200
    assert client.get("/").status_code == 200


def test_run_detail_shape(client, auth):
    r = client.get(DETAIL.replace("+", "%2B"), headers=auth)
    assert r.status_code == 200, r.text
    d = r.json()
    assert d["run_id"] == RUN and d["state"] == "running"
    assert [(x["rank"], x["step"], x["healthy"]) for x in d["ranks"]] == [(0, 10, True), (1, 11, True)]
    assert [(p["step"], p["loss"]) for p in d["loss_curve"]] == [(1, 2.3), (10, 0.7)]
    assert [(e["event"], e["kind"], e["message"]) for e in d["timeline"]] == [("stall_detected", "fault", XSS)]
    for key in ("checkpoints", "errors", "node_agents"):
        assert d[key] == []
    assert d["evaluation"] is None and d["spec"]["nodes"] == 2


def test_an_unknown_run_is_404_with_a_message(client, auth):
    r = client.get("/api/runs/default/train_digits/nope", headers=auth)
    assert r.status_code == 404
    assert r.json() == {"detail": "no run default/train_digits/nope: no workspace with a plan or spec"}


@pytest.mark.parametrize(
    "path, loc",
    [
        ("/api/runs/Default/train_digits/x", ["path", "tenant"]),
        ("/api/runs/default/train%20digits/x", ["path", "dag_id"]),
        ("/api/runs/default/train_digits/-x", ["path", "run_id"]),
        ("/api/runs/default/train_digits/a..b", ["path", "run_id"]),
        ("/api/runs?limit=0", ["query", "limit"]),
        ("/api/runs?limit=many", ["query", "limit"]),
        ("/api/runs?tenant=A_B", ["query", "tenant"]),
    ],
    ids=["tenant", "dag-id", "run-id", "dotdot", "limit-low", "limit-type", "tenant-query"],
)
def test_a_malformed_parameter_is_422_naming_it(client, auth, path, loc):
    r = client.get(path, headers=auth)
    assert r.status_code == 422
    assert [e["loc"] for e in r.json()["detail"]] == [loc]


def test_the_page_is_self_contained(client, auth):
    r = client.get("/", headers=auth)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    page = r.text
    assert 'const API = "/api"' in page and "<svg" in page and "setTimeout(tick" in page
    for external in ("http://", "https://", "<link", "src="):
        assert external not in page  # works offline: no CDN, no external script or style


def test_the_openapi_documents_the_routes_and_their_security(client):
    spec = client.get("/openapi.json").json()
    detail = spec["paths"]["/api/runs/{tenant}/{dag_id}/{run_id}"]["get"]
    assert {"200", "401", "403", "404", "422"} <= set(detail["responses"])
    assert detail["security"] and "OAuth2PasswordBearer" in spec["components"]["securitySchemes"]
    assert {p["name"] for p in spec["paths"]["/api/runs"]["get"]["parameters"]} == {"tenant", "dag_id", "limit"}
    assert "RunDetail" in spec["components"]["schemas"]


def test_the_plugin_mounts_the_app_and_the_page_calls_the_mounted_api(airflow_auth, ui, home, monkeypatch):
    """As the api-server mounts it (``init_plugins``): under the prefix, built lazily."""
    from airflow.api_fastapi.core_api.datamodels.plugins import ExternalViewResponse, FastAPIAppResponse
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    monkeypatch.setenv("TRAINFLOW_HOME", str(home))
    [entry] = ui.TrainflowUIPlugin.fastapi_apps
    FastAPIAppResponse(**{**entry, "app": "x"})
    [view] = ui.TrainflowUIPlugin.external_views
    assert ExternalViewResponse(**view).href == "/trainflow/"
    root = FastAPI()
    root.mount(entry["url_prefix"], entry["app"])
    for mw in ui.TrainflowUIPlugin.fastapi_root_middlewares:  # as init_plugins adds them
        root.add_middleware(mw["middleware"], *mw.get("args", []), **mw.get("kwargs", {}))
    with TestClient(root) as c:
        headers = {"Authorization": f"Bearer {token(airflow_auth)}"}
        page = c.get("/trainflow/", headers=headers).text
        assert 'const API = "/trainflow/api"' in page and 'UI = ""' in page  # task-log links: the UI's root
        # The bare prefix would fall through to the UI's catch-all: it redirects instead.
        bare = c.get("/trainflow?x=1", follow_redirects=False)
        assert (bare.status_code, bare.headers["location"]) == (308, "/trainflow/?x=1")
        assert c.get("/trainflowx", follow_redirects=False).status_code == 404  # only the prefix itself
        assert [r["run_id"] for r in c.get("/trainflow/api/runs", headers=headers).json()] == [RUN]
        assert c.get("/trainflow/api/runs").status_code == 401


def test_importing_the_plugin_is_cheap(tmp_path):
    code = (
        "import sys, trainflow_ui; heavy = [m for m in ('fastapi', 'airflow.api_fastapi.core_api.security', "
        "'trainflow.ui.data', 'torch') if m in sys.modules]; print(heavy)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=PLUGINS,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(PLUGINS), "AIRFLOW_HOME": str(tmp_path)},
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"


# The page's script run by node against the API's answers, with a stub DOM and fetch.
PAGE_HARNESS = """
const els = {};
const el = id => els[id] || (els[id] = {innerHTML: "", textContent: ""});
globalThis.document = {getElementById: el, querySelectorAll: () => []};
globalThis.location = {hash: ""};
globalThis.window = {addEventListener: () => {}};
const ANSWERS = __ANSWERS__;
globalThis.fetch = async (url, opts) => {
  if (opts.credentials !== "same-origin") throw new Error("the UI session cookie must go along");
  const [status, body] = ANSWERS[url] || [404, {detail: "unexpected " + url}];
  return {ok: status === 200, status, json: async () => body};
};
globalThis.setTimeout = (f, ms) => { globalThis.nextMs = ms; return 1; };
globalThis.clearTimeout = () => {};
__SCRIPT__
(async () => {
  for (let i = 0; i < 50; i++) await new Promise(r => setImmediate(r));
  console.log(JSON.stringify({runs: el("runs").innerHTML, detail: el("detail").innerHTML,
                              msg: el("msg").innerHTML, next: globalThis.nextMs}));
})();
"""


def run_page(page: str, answers: dict) -> dict:
    script = re.search(r"<script>(.*)</script>", page, re.S).group(1)
    js = PAGE_HARNESS.replace("__ANSWERS__", json.dumps(answers)).replace("__SCRIPT__", script)
    out = subprocess.run(["node", "-"], input=js, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(shutil.which("node") is None, reason="needs node to run the page's script")
def test_the_page_script_renders_a_live_run_and_escapes_its_text(client, auth, ui):
    detail = f"/api/runs/default/train_digits/{RUN.replace(':', '%3A').replace('+', '%2B')}"
    answers = {"/api/runs": client.get("/api/runs", headers=auth), detail: client.get(DETAIL, headers=auth)}
    answers = {url: [r.status_code, r.json()] for url, r in answers.items()}
    got = run_page(client.get("/", headers=auth).text, answers)
    assert got["msg"] == "" and got["next"] == ui.LIVE_REFRESH_MS  # live: polls fast
    assert RUN in got["runs"] and "10/60" in got["runs"]
    assert got["detail"].count(">healthy<") == 2 and '<path d="M' in got["detail"]
    assert "stall_detected" in got["detail"] and XSS not in got["detail"] and "&lt;img" in got["detail"]

    signed_out = {"/api/runs": [401, {"detail": "Not authenticated"}]}
    got = run_page(client.get("/", headers=auth).text, signed_out)
    assert "Not signed in to Airflow (HTTP 401)" in got["msg"]


def test_access_follows_the_auth_managers_per_dag_decision(airflow_auth, ui, tmp_path, monkeypatch):
    """Two tenants' DAGs; the auth manager lets the viewer read only ``train_digits``: the
    other tenant's run is neither listed nor readable (403), whatever the query says."""
    from fastapi.testclient import TestClient

    home = tmp_path / "trainflow"
    spec = TrainingSpec(nodes=1, steps=10, checkpoint_interval=5)
    for tenant, dag_id in (("team-a", "train_digits"), ("team-b", "team_b_train")):
        ws = Workspace(home / "runs", tenant, dag_id, "r1").create()
        write_json_atomic(ws.spec_file, spec.to_dict())
        write_json_atomic(
            ws.plan_file, build_plan(spec, dag_id=dag_id, run_id="r1", run_dir=str(ws.dir), rdzv_endpoint="sqlite:///x")
        )
    real = type(airflow_auth).is_authorized_dag
    asked = []

    def only_digits(self, *, method, user, access_entity=None, details=None):
        asked.append(details.id if details else None)
        return (details is None or details.id in (None, "train_digits")) and real(
            self, method=method, user=user, access_entity=access_entity, details=details
        )

    monkeypatch.setattr(type(airflow_auth), "is_authorized_dag", only_digits)
    monkeypatch.setenv("TRAINFLOW_HOME", str(home))
    auth = {"Authorization": f"Bearer {token(airflow_auth)}"}
    with TestClient(ui.create_app()) as c:
        assert [(r["tenant"], r["dag_id"]) for r in c.get("/api/runs", headers=auth).json()] == [
            ("team-a", "train_digits")
        ]
        assert c.get("/api/runs?tenant=team-b", headers=auth).json() == []
        assert c.get("/api/runs/team-b/team_b_train/r1", headers=auth).status_code == 403
        assert c.get("/api/runs/team-a/train_digits/r1", headers=auth).status_code == 200
    assert "team_b_train" in asked  # the decision was the auth manager's
