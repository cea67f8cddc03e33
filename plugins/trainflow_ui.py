"""The training page: an Airflow 3 plugin serving a JSON API and one HTML page.

Mounted by the api-server under ``/trainflow``:

- ``GET /trainflow/api/runs``: every run's summary (``trainflow.ui.data.list_runs``);
- ``GET /trainflow/api/runs/{tenant}/{dag_id}/{run_id}``: one run (``run_detail``);
- ``GET /trainflow/``: the page (inline JS and SVG, no external resource), which polls the
  API with the browser's Airflow session cookie; it is linked in the UI's navigation.

Authentication and authorization are Airflow's own FastAPI dependencies
(``airflow.api_fastapi.core_api.security``): ``get_user`` reads the JWT from the
``Authorization: Bearer`` header or the UI's ``_token`` cookie (401 without one or when
expired, 403 when invalid), ``requires_access_dag("GET", DagAccessEntity.RUN)`` asks the
auth manager for the DAG's runs (403), and the list only holds DAGs the caller may read.

Airflow imports plugins in every component, so this module imports only the plugin base
class; the app (FastAPI, Airflow's security module, trainflow) is built on the first request.
"""

# No ``from __future__ import annotations``: FastAPI reads the route signatures below at
# runtime, and their types are imported inside ``create_app``.
import html
import json
from typing import Any, Callable

from airflow.plugins_manager import AirflowPlugin

URL_PREFIX = "/trainflow"
TENANT_PATTERN = r"^[a-z0-9][a-z0-9-]{0,62}$"  # trainflow.workspace.Workspace's tenant rule
# How often the page polls while a run is live, and otherwise (for new runs).
LIVE_REFRESH_MS = 3000
IDLE_REFRESH_MS = 15000


class LazyASGIApp:
    """An ASGI app that builds the real one on its first call, so importing the plugin
    (scheduler, workers, dag-processor) does not import FastAPI and Airflow's API security."""

    def __init__(self, factory: Callable[[], Any]) -> None:
        self._factory = factory
        self._app: Any = None

    @property
    def app(self) -> Any:
        if self._app is None:
            self._app = self._factory()  # synchronous: no other request can interleave
        return self._app

    async def __call__(self, scope, receive, send) -> None:
        await self.app(scope, receive, send)


class SlashRedirect:
    """Root middleware: ``/trainflow`` (no slash) answers 308 to ``/trainflow/``. The plugin
    app is mounted at the prefix and matches only paths below it; without this the bare
    prefix falls through to the Airflow UI's catch-all route and shows its 404 page."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        root = scope.get("root_path", "").rstrip("/")
        # Starlette's path may or may not carry the root path (it changed across versions).
        if scope["type"] == "http" and scope.get("path") in (URL_PREFIX, root + URL_PREFIX):
            target = root + URL_PREFIX + "/"
            if scope.get("query_string"):
                target += "?" + scope["query_string"].decode("latin-1")
            await send(
                {
                    "type": "http.response.start",
                    "status": 308,
                    "headers": [(b"location", target.encode("latin-1")), (b"content-length", b"0")],
                }
            )
            await send({"type": "http.response.body", "body": b""})
            return
        await self.app(scope, receive, send)


def _cordoned(host: str):
    """The host's cordon in trainflow's host registry; None where the registry cannot be read
    (the page still shows the run)."""
    from trainflow.cluster.hosts import HostRegistry

    try:
        return HostRegistry().cordoned(host)
    except Exception:  # noqa: BLE001 - a missing or unreachable state database hides the column only
        return None


def _task_states(dag_id: str, run_id: str) -> dict[int, str | None]:
    """Airflow's state of each ``shard_train`` task instance of the run (map index → state),
    read from the metadata database; {} where it cannot be read (the column stays empty)."""
    try:
        from airflow.models.taskinstance import TaskInstance
        from airflow.utils.session import create_session
        from sqlalchemy import select

        with create_session() as session:
            rows = session.execute(
                select(TaskInstance.map_index, TaskInstance.state).where(
                    TaskInstance.dag_id == dag_id, TaskInstance.run_id == run_id, TaskInstance.task_id == "shard_train"
                )
            ).all()
    except Exception:  # noqa: BLE001 - the metadata database unreachable: the page still shows the run
        return {}
    return {int(index): (None if state is None else str(getattr(state, "value", state))) for index, state in rows}


def create_app():
    """The FastAPI app of the training page (API and HTML)."""
    from typing import Annotated

    from airflow.api_fastapi.app import get_auth_manager
    from airflow.api_fastapi.auth.managers.models.resource_details import AccessView, DagAccessEntity
    from airflow.api_fastapi.core_api.security import GetUserDep, requires_access_dag, requires_access_view
    from fastapi import Depends, FastAPI, HTTPException, Path, Query, Request, status
    from fastapi.exception_handlers import http_exception_handler
    from fastapi.responses import HTMLResponse, JSONResponse
    from pydantic import BaseModel, ConfigDict, Field

    from trainflow.errors import SpecError
    from trainflow.ui import data
    from trainflow.workspace import DAG_ID_PATTERN, RUN_ID_PATTERN, default_root

    class RunSummary(BaseModel):
        """One run, as its workspace shows it now."""

        model_config = ConfigDict(extra="allow")
        tenant: str
        dag_id: str
        run_id: str = Field(description="The Airflow DAG run id.")
        workload: str | None = None
        chip: str | None = Field(None, description="Chip family of the run's queue.")
        strategy: str | None = None
        nodes: int | str | None = Field(None, description="Nodes of the gang: N, or 'min:max' (elastic).")
        world_size: int = Field(description="Ranks of the full gang.")
        current_world_size: int | None = Field(None, description="Ranks of the gang running now.")
        ranks_reporting: int
        step: int | None = Field(None, description="Slowest rank's step.")
        total_steps: int | None = None
        loss: float | None = Field(None, description="Rank 0's latest training loss.")
        samples_per_s: float | None = Field(None, description="Sum over the gang's ranks.")
        last_heartbeat_age_s: float | None = Field(None, description="Seconds since any rank's last heartbeat.")
        state: data.RunState = Field(description="pending, running, healing, stalled, preempted, completed or failed.")
        state_reason: str = Field(description="One line: why the run is in this state.")
        evaluated: bool = Field(description="metrics.json was written (the evaluate task ran).")
        goodput: float | None = Field(
            None,
            description="Share of the run's wall time so far that went into "
            "training that was kept (1 − recovery − redone steps).",
        )
        allocation: dict[str, Any] | None = Field(
            None,
            description="pool, held (slots holding a node now), "
            "slots (largest gang + spares), released "
            "(when the release teardown freed them).",
        )
        updated: float = Field(description="Unix time of the latest activity.")

    class RankHealth(BaseModel):
        model_config = ConfigDict(extra="allow")
        rank: int
        node: int | None = None
        state: str | None = None
        step: int | None = None
        loss: float | None = None
        samples_per_s: float | None = None
        progress_age_s: float = Field(description="Seconds since this rank's step last advanced.")
        alive_age_s: float = Field(description="Seconds since this rank's last liveness pulse.")
        in_gang: bool
        healthy: bool

    class LossPoint(BaseModel):
        step: int
        loss: float
        time: float | None = None

    class CheckpointInfo(BaseModel):
        model_config = ConfigDict(extra="allow")
        step: int
        path: str
        bytes: int
        verified: bool = Field(description="Manifest parses and every file has its size and SHA-256.")

    class RunDetail(RunSummary):
        """One run in full."""

        spec: dict[str, Any]
        ranks: list[RankHealth]
        node_agents: list[dict[str, Any]] = Field(
            description="Per node: agent state, its task's Airflow state, host, try within the run's retry "
            "budget, tries left, the host's cordon, start, end, error."
        )
        loss_curve: list[LossPoint] = Field(description="Rank 0's loss, at most once per heartbeat interval.")
        evaluation: dict[str, Any] | None = Field(None, description="metrics.json of the evaluate task.")
        report_available: bool
        checkpoints: list[CheckpointInfo] = Field(description="Committed checkpoints, newest first.")
        errors: list[dict[str, Any]]
        timeline: list[dict[str, Any]] = Field(description="Events, each with kind fault, recovery or info.")
        faults: list[dict[str, Any]] = Field(
            description="Each fault: kind, time, step, detection_s, recovery_s, "
            "resumed_from_step, steps_lost, membership."
        )
        membership: list[dict[str, Any]] = Field(
            description="Gang changes: change (shrink, grow, spare_used, replaced), world_from, world_to, joined, left."
        )
        recovery_s: float | None = Field(None, description="Seconds spent recovering from faults.")
        steps_lost: int | None = Field(None, description="Steps trained again after faults.")
        now: float

    class Message(BaseModel):
        detail: str

    app = FastAPI(
        title="trainflow training page API",
        description="Training runs read from their workspaces. Authenticate like Airflow's REST API: "
        "`Authorization: Bearer <JWT from POST /auth/token>` or the Airflow UI session.",
        version="1",
    )

    @app.exception_handler(SpecError)
    async def _bad_name(request: Request, exc: SpecError) -> JSONResponse:
        # Names that match the path patterns but would still escape the root (``..``).
        return JSONResponse(
            status_code=422,
            content={
                "detail": [{"type": "value_error", "loc": ["path", exc.field], "msg": str(exc), "input": exc.value}]
            },
        )

    @app.exception_handler(HTTPException)
    async def _sign_in(request: Request, exc: HTTPException):
        # A browser opening the page without a session still gets Airflow's 401, with a link
        # to the auth manager's login page that brings it back here.
        if (
            exc.status_code == 401
            and request.url.path.endswith("/")
            and "text/html" in request.headers.get("accept", "")
        ):
            login = html.escape(get_auth_manager().get_url_login(next_url=str(request.url)))
            return HTMLResponse(
                f"<!doctype html><title>Sign in</title><p>{html.escape(str(exc.detail))}: "
                f'<a href="{login}">sign in to Airflow</a>, then come back.</p>',
                status_code=401,
                headers=exc.headers,
            )
        return await http_exception_handler(request, exc)

    auth_errors = {
        401: {"model": Message, "description": "No token, or an expired one"},
        403: {"model": Message, "description": "Invalid token, or no access to the DAG's runs"},
    }
    read_runs = Depends(requires_access_dag("GET", DagAccessEntity.RUN))

    @app.get(
        "/api/runs",
        response_model=list[RunSummary],
        responses=auth_errors,
        dependencies=[read_runs],
        summary="List training runs",
    )
    def runs(
        user: GetUserDep,
        tenant: Annotated[str | None, Query(pattern=TENANT_PATTERN, description="Only this tenant")] = None,
        dag_id: Annotated[str | None, Query(pattern=DAG_ID_PATTERN, description="Only this DAG")] = None,
        limit: Annotated[int, Query(ge=1, le=1000, description="At most this many, newest first")] = 100,
    ) -> list[dict]:
        rows = data.list_runs(default_root(), tenant=tenant, dag_id=dag_id)
        readable = get_auth_manager().filter_authorized_dag_ids(
            dag_ids={r["dag_id"] for r in rows}, user=user, method="GET"
        )
        return [r for r in rows if r["dag_id"] in readable][:limit]

    @app.get(
        "/api/runs/{tenant}/{dag_id}/{run_id}",
        response_model=RunDetail,
        responses={**auth_errors, 404: {"model": Message, "description": "No such run"}},
        dependencies=[read_runs],
        summary="One training run",
    )
    def run(
        tenant: Annotated[str, Path(pattern=TENANT_PATTERN)],
        dag_id: Annotated[str, Path(pattern=DAG_ID_PATTERN)],
        run_id: Annotated[str, Path(pattern=RUN_ID_PATTERN)],
    ) -> dict:
        try:
            return data.run_detail(default_root(), tenant, dag_id, run_id, cordoned=_cordoned, task_states=_task_states)
        except data.RunNotFoundError as exc:
            raise HTTPException(status.HTTP_404_NOT_FOUND, str(exc)) from None

    @app.get(
        "/",
        response_class=HTMLResponse,
        responses=auth_errors,
        dependencies=[Depends(requires_access_view(AccessView.WEBSITE))],
        summary="The training page",
    )
    def page(request: Request) -> HTMLResponse:
        # The mount prefix (and the api-server's root path) come with the request.
        root = request.scope.get("root_path", "").rstrip("/")
        ui = root[: -len(URL_PREFIX)] if root.endswith(URL_PREFIX) else ""
        return HTMLResponse(render_page(root + "/api", ui))

    return app


def render_page(api_base: str, ui_base: str = "") -> str:
    """The page, with the API's base path and the Airflow UI's (for links to task logs)
    filled in as JS string literals."""
    literal = json.dumps(api_base).replace("<", "\\u003c")
    ui = json.dumps(ui_base).replace("<", "\\u003c")
    return (
        PAGE.replace("__API__", literal)
        .replace("__UI__", ui)
        .replace("__LIVE_MS__", str(LIVE_REFRESH_MS))
        .replace("__IDLE_MS__", str(IDLE_REFRESH_MS))
    )


class TrainflowUIPlugin(AirflowPlugin):
    """The training page and its API in the Airflow UI."""

    name = "trainflow_ui"
    fastapi_apps = [{"app": LazyASGIApp(create_app), "url_prefix": URL_PREFIX, "name": "trainflow"}]
    fastapi_root_middlewares = [{"middleware": SlashRedirect, "name": "trainflow_slash"}]
    # A top-level button of the UI's navigation; with url_route the UI shows the page in a
    # frame at /plugin/training (same origin: the page's API calls carry the session cookie).
    external_views = [
        {
            "name": "Training",
            "href": URL_PREFIX + "/",
            "destination": "nav",
            "url_route": "training",
            "nav_top_level": True,
        }
    ]


PAGE = r"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width,initial-scale=1">
<title>Training runs</title>
<style>
:root{--fg:#1f2328;--muted:#656d76;--bg:#fff;--line:#d0d7de;--ok:#1a7f37;--bad:#cf222e;--warn:#9a6700;--run:#0969da;--panel:#f6f8fa}
@media (prefers-color-scheme:dark){:root{--fg:#e6edf3;--muted:#8d96a0;--bg:#0d1117;--line:#30363d;--panel:#161b22;--ok:#3fb950;--bad:#f85149;--warn:#d29922;--run:#58a6ff}}
body{font:14px/1.4 system-ui,sans-serif;color:var(--fg);background:var(--bg);margin:16px}
h1{font-size:20px;margin:0 0 8px}h2{font-size:16px;margin:18px 0 6px}
table{border-collapse:collapse;width:100%}th,td{text-align:left;padding:4px 8px;border-bottom:1px solid var(--line);white-space:nowrap}
th{color:var(--muted);font-weight:600}tbody tr.run{cursor:pointer}tbody tr.run:hover,tr.sel{background:var(--panel)}
.badge{display:inline-block;padding:0 6px;border-radius:8px;font-size:12px;border:1px solid currentColor}
.running{color:var(--run)}.pending{color:var(--muted)}.completed{color:var(--ok)}.failed,.stalled,.fault{color:var(--bad)}.recovery{color:var(--ok)}.info{color:var(--muted)}
.bar{display:inline-block;width:80px;height:6px;background:var(--line);vertical-align:middle;margin-left:6px}.bar i{display:block;height:6px;background:var(--run)}
.muted{color:var(--muted)}.grid{display:grid;grid-template-columns:repeat(auto-fit,minmax(420px,1fr));gap:16px}
.panel{border:1px solid var(--line);border-radius:6px;padding:8px 12px}#msg{padding:6px 0}.path{font-family:monospace;font-size:12px}
svg text{fill:var(--muted);font-size:11px}
</style></head><body>
<h1>Training runs <button id="refresh">Refresh</button> <span id="status" class="muted"></span></h1>
<div id="msg"></div>
<table><thead><tr><th>State</th><th>DAG / run</th><th>Workload</th><th>Chip</th><th>Nodes</th><th>Ranks</th>
<th>Step</th><th>Loss</th><th>Samples/s</th><th>Goodput</th><th>Allocation</th><th>Last heartbeat</th></tr></thead><tbody id="runs"></tbody></table>
<div id="detail"></div>
<script>
"use strict";
const API = __API__, UI = __UI__, LIVE_MS = __LIVE_MS__, IDLE_MS = __IDLE_MS__;
const LIVE = new Set(["pending", "running", "stalled"]);
let selected = location.hash.length > 1 ? decodeURIComponent(location.hash.slice(1)) : null, timer = null;
const esc = s => String(s ?? "").replace(/[&<>"']/g, c => ({"&":"&amp;","<":"&lt;",">":"&gt;",'"':"&quot;","'":"&#39;"})[c]);
const num = (v, d = 0) => v == null ? "" : Number(v).toLocaleString(undefined, {maximumFractionDigits: d});
const age = s => s == null ? "" : s < 120 ? num(s, 1) + " s ago" : s < 7200 ? num(s / 60, 1) + " min ago" : num(s / 3600, 1) + " h ago";
const when = t => t == null ? "" : new Date(t * 1000).toLocaleTimeString();
const badge = s => `<span class="badge ${esc(s)}">${esc(s)}</span>`;
const key = r => `${r.tenant}/${r.dag_id}/${r.run_id}`;
const pctOf = v => v == null ? "" : num(100 * v, 1) + " %";
const secs = v => v == null ? "" : num(v, 1) + " s";
const alloc = a => a == null ? "" : a.released ? `<span class="muted">released (${esc(a.pool)})</span>` : `${esc(a.held)}${a.slots == null ? "" : "/" + esc(a.slots)} <span class="muted">${esc(a.pool)}</span>`;
// Airflow UI pages of the run's task instances (the node tasks are one mapped task).
const taskUrl = (d, task, index) => `${UI}/dags/${encodeURIComponent(d.dag_id)}/runs/${encodeURIComponent(d.run_id)}/tasks/${task}` + (index == null ? "" : `/mapped/${index}`);
function taskLinks(d) {
  const nodes = d.node_agents.map(n => n.node);
  const links = [["provision"], ...nodes.map(n => ["shard_train", n]), ["heartbeat_watch"], ["checkpoint_sync"], ["evaluate"], ["release"]];
  return links.map(([t, i]) => `<a href="${esc(taskUrl(d, t, i))}" target="_top">${esc(t)}${i == null ? "" : "[" + i + "]"}</a>`).join(" · ");
}
async function get(path) {
  const r = await fetch(API + path, {credentials: "same-origin", headers: {Accept: "application/json"}});
  if (r.status === 401 || r.status === 403) throw new Error("Not signed in to Airflow (HTTP " + r.status + "): sign in to the Airflow UI, then reload.");
  if (!r.ok) { let d = ""; try { d = JSON.stringify((await r.json()).detail); } catch (e) {} throw new Error("HTTP " + r.status + " " + d); }
  return r.json();
}
function runsTable(runs) {
  document.getElementById("runs").innerHTML = runs.map(r => {
    const pct = r.total_steps ? Math.min(100, 100 * (r.step || 0) / r.total_steps) : 0;
    return `<tr class="run ${key(r) === selected ? "sel" : ""}" data-key="${esc(key(r))}"><td>${badge(r.state)}</td>
      <td>${esc(r.dag_id)} / ${esc(r.run_id)} <span class="muted">${esc(r.tenant)}</span></td><td>${esc(r.workload)}</td>
      <td>${esc(r.chip)}</td><td>${esc(r.nodes)}</td><td>${esc(r.ranks_reporting)}/${esc(r.current_world_size ?? r.world_size)}</td>
      <td>${esc(r.step ?? "")}/${esc(r.total_steps)}<span class="bar"><i style="width:${pct}%"></i></span></td>
      <td>${num(r.loss, 4)}</td><td>${num(r.samples_per_s)}</td><td>${pctOf(r.goodput)}</td><td>${alloc(r.allocation)}</td>
      <td>${age(r.last_heartbeat_age_s)}</td></tr>`;
  }).join("") || `<tr><td colspan="12" class="muted">No runs yet.</td></tr>`;
  for (const tr of document.querySelectorAll("tr.run")) tr.onclick = () => { selected = tr.dataset.key; location.hash = encodeURIComponent(selected); tick(); };
}
function lossChart(points) {
  if (!points.length) return `<p class="muted">No loss recorded yet.</p>`;
  const W = 460, H = 200, L = 48, B = 24, T = 8, R = 8;
  const xs = points.map(p => p.step), ys = points.map(p => p.loss);
  const x0 = Math.min(...xs), x1 = Math.max(...xs, x0 + 1), y0 = Math.min(0, ...ys), y1 = Math.max(...ys, y0 + 1e-9);
  const X = v => L + (W - L - R) * (v - x0) / (x1 - x0), Y = v => T + (H - T - B) * (1 - (v - y0) / (y1 - y0));
  const path = points.map((p, i) => (i ? "L" : "M") + X(p.step).toFixed(1) + " " + Y(p.loss).toFixed(1)).join("");
  const ticks = [0, 0.5, 1].map(f => y0 + f * (y1 - y0));
  return `<svg viewBox="0 0 ${W} ${H}" width="100%" role="img" aria-label="training loss by step">
    <line x1="${L}" y1="${H - B}" x2="${W - R}" y2="${H - B}" stroke="currentColor" opacity=".3"/>
    <line x1="${L}" y1="${T}" x2="${L}" y2="${H - B}" stroke="currentColor" opacity=".3"/>
    ${ticks.map(v => `<text x="${L - 4}" y="${Y(v) + 4}" text-anchor="end">${num(v, 3)}</text>`).join("")}
    <text x="${L}" y="${H - 6}">step ${num(x0)}</text><text x="${W - R}" y="${H - 6}" text-anchor="end">step ${num(x1)}</text>
    <path d="${path}" fill="none" stroke="var(--run)" stroke-width="2"/>
    ${points.length < 60 ? points.map(p => `<circle cx="${X(p.step)}" cy="${Y(p.loss)}" r="2.5" fill="var(--run)"><title>step ${p.step}: ${p.loss}</title></circle>`).join("") : ""}
  </svg>`;
}
function detailView(d) {
  const ranks = d.ranks.map(r => `<tr><td>${r.rank}</td><td>${esc(r.node)}</td><td><span class="badge ${r.healthy ? "completed" : "failed"}">${r.healthy ? "healthy" : "unhealthy"}</span></td>
    <td>${esc(r.state)}${r.in_gang ? "" : " (left gang)"}</td><td>${esc(r.step)}</td><td>${num(r.loss, 4)}</td><td>${num(r.samples_per_s)}</td>
    <td>${age(r.progress_age_s)}</td><td>${age(r.alive_age_s)}</td><td>${esc(r.phase)}</td></tr>`).join("");
  const nodes = d.node_agents.map(n => `<tr><td>${n.node}</td><td>${esc(n.state)}</td><td>${esc(n.task_state || "")}</td><td>${esc(n.host || "")}</td>
    <td>${esc(n.try ?? "")}</td><td>${esc(n.tries_left ?? "")}</td><td class="${n.cordoned ? "failed" : ""}">${n.cordoned ? "cordoned: " + esc(n.cordoned.reason) : ""}</td>
    <td>${when(n.started)}</td><td>${when(n.ended)}</td><td>${esc(n.error || "")}</td></tr>`).join("");
  const ckpts = d.checkpoints.map(c => `<tr><td>${c.step}</td><td>${num(c.bytes)}</td>
    <td class="${c.verified ? "completed" : "failed"}">${c.verified ? "verified" : "NOT verified"}</td><td class="path">${esc(c.path)}</td></tr>`).join("");
  const events = d.timeline.filter(e => e.kind !== "info").reverse().map(e => {
    const rest = Object.entries(e).filter(([k]) => !["time", "event", "kind"].includes(k)).map(([k, v]) => `${esc(k)}=${esc(typeof v === "object" ? JSON.stringify(v) : v)}`).join(" ");
    return `<tr><td>${when(e.time)}</td><td class="${esc(e.kind)}">${esc(e.event)}</td><td>${rest}</td></tr>`;
  }).join("");
  const faults = d.faults.slice().reverse().map(f => `<tr><td>${when(f.time)}</td><td class="fault">${esc(f.kind)}</td><td>${esc(f.step ?? "")}</td>
    <td>${secs(f.detection_s)}</td><td class="${f.recovery_s == null ? "muted" : "recovery"}">${f.recovery_s == null ? (f.restarts ? "recovering" : "no restart") : secs(f.recovery_s)}</td>
    <td>${esc(f.resumed_from_step ?? "")}</td><td>${esc(f.steps_lost ?? "")}</td><td>${f.membership ? esc(f.membership.change) + " " + esc(f.membership.world_from) + "→" + esc(f.membership.world_to) : ""}</td></tr>`).join("");
  const members = d.membership.slice().reverse().map(m => `<tr><td>${when(m.time)}</td><td class="recovery">${esc(m.change)}</td><td>${esc(m.step)}</td>
    <td>${esc(m.world_from)} → ${esc(m.world_to)}</td><td>${esc(JSON.stringify(m.nodes_from ?? ""))} → ${esc(JSON.stringify(m.nodes_to ?? ""))}</td>
    <td>${esc((m.joined || []).join(", "))}</td><td>${esc((m.left || []).join(", "))}</td><td>${esc((m.spares_used || []).join(", "))}</td></tr>`).join("");
  const ev = d.evaluation;
  const evalHtml = ev ? `<table>${Object.entries(ev.metrics || {}).map(([k, v]) => `<tr><th>${esc(k)}</th><td>${esc(typeof v === "number" ? num(v, 4) : v)}</td></tr>`).join("")}
    ${ev.target ? `<tr><th>target</th><td class="${ev.target.met ? "completed" : "failed"}">${esc(ev.target.metric)} ${esc(ev.target.op)} ${esc(ev.target.value)}: ${ev.target.met ? "met" : "not met"}</td></tr>` : ""}
    <tr><th>checkpoint step</th><td>${esc(ev.step)}</td></tr></table>` : `<p class="muted">Not evaluated yet.</p>`;
  const errors = d.errors.map(e => `<tr><td>${esc(e.rank)}</td><td>${esc(e.kind)}</td><td>${esc(e.type)}</td><td>${esc(e.message)}</td></tr>`).join("");
  return `<h2>${esc(d.dag_id)} / ${esc(d.run_id)} ${badge(d.state)} <span class="muted">${esc(d.state_reason)}</span></h2>
  <div class="grid">
   <div class="panel"><h2>Loss</h2>${lossChart(d.loss_curve)}</div>
   <div class="panel"><h2>Evaluation</h2>${evalHtml}</div>
  </div>
  <h2>Ranks</h2><table id="ranks"><thead><tr><th>Rank</th><th>Node</th><th>Health</th><th>State</th><th>Step</th><th>Loss</th><th>Samples/s</th><th>Progress</th><th>Alive</th><th>Phase</th></tr></thead><tbody>${ranks || `<tr><td colspan="10" class="muted">No heartbeats yet.</td></tr>`}</tbody></table>
  <h2>Node agents</h2><table id="nodes"><thead><tr><th>Node</th><th>Agent</th><th>Airflow task</th><th>Host</th><th>Try</th><th>Tries left</th><th>Cordon</th><th>Started</th><th>Ended</th><th>Error</th></tr></thead><tbody>${nodes}</tbody></table>
  <h2>Checkpoints</h2><table><thead><tr><th>Step</th><th>Bytes</th><th>Verified</th><th>Path</th></tr></thead><tbody>${ckpts || `<tr><td colspan="4" class="muted">None yet.</td></tr>`}</tbody></table>
  ${errors ? `<h2>Errors</h2><table><thead><tr><th>Rank</th><th>Kind</th><th>Type</th><th>Message</th></tr></thead><tbody>${errors}</tbody></table>` : ""}
  <h2>Faults <span class="muted">goodput ${pctOf(d.goodput)}, ${secs(d.recovery_s)} recovering, ${esc(d.steps_lost ?? 0)} steps redone</span></h2>
  <table id="faults"><thead><tr><th>Time</th><th>Fault</th><th>Step</th><th>Detected after</th><th>Recovered after</th><th>Resumed from</th><th>Steps lost</th><th>Gang</th></tr></thead>
  <tbody>${faults || `<tr><td colspan="8" class="muted">No faults.</td></tr>`}</tbody></table>
  <h2>Gang membership</h2><table id="membership"><thead><tr><th>Time</th><th>Change</th><th>At step</th><th>World</th><th>Nodes</th><th>Joined</th><th>Left</th><th>Spares used</th></tr></thead>
  <tbody>${members || `<tr><td colspan="8" class="muted">Unchanged since the start.</td></tr>`}</tbody></table>
  <h2>Task logs</h2><p id="tasks">${taskLinks(d)}</p>
  <h2>Events</h2><table><thead><tr><th>Time</th><th>Event</th><th>Details</th></tr></thead><tbody>${events || `<tr><td colspan="3" class="muted">No faults.</td></tr>`}</tbody></table>`;
}
// A link or the address bar may name another run (#tenant/dag/run): follow it.
window.addEventListener("hashchange", () => {
  const want = location.hash.length > 1 ? decodeURIComponent(location.hash.slice(1)) : null;
  if (want && want !== selected) { selected = want; tick(); }
});
async function tick() {
  clearTimeout(timer);
  const msg = document.getElementById("msg");
  let live = false;
  try {
    const runs = await get("/runs");
    if (!selected && runs.length) selected = key(runs[0]);
    runsTable(runs);
    live = runs.some(r => LIVE.has(r.state));
    if (selected) {
      const d = await get("/runs/" + selected.split("/").map(encodeURIComponent).join("/"));
      document.getElementById("detail").innerHTML = detailView(d);
      live = LIVE.has(d.state);
    }
    msg.textContent = "";
  } catch (e) { msg.innerHTML = `<span class="failed">${esc(e.message)}</span>`; }
  document.getElementById("status").textContent = `updated ${new Date().toLocaleTimeString()}` + (live ? ", live: refreshing every " + LIVE_MS / 1000 + " s" : "");
  timer = setTimeout(tick, live ? LIVE_MS : IDLE_MS);
}
document.getElementById("refresh").onclick = tick;
window.onhashchange = () => { selected = decodeURIComponent(location.hash.slice(1)) || null; tick(); };
tick();
</script></body></html>
"""
