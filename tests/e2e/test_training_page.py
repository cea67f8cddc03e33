"""The training page on the real embedded stack: the plugin mounted by the api-server,
secured by Airflow's own auth, reading a run trained over REST."""

from __future__ import annotations

import argparse
import json
import time
import urllib.error
import urllib.request

import pytest

from trainflow.testing import browser as browser_tools
from trainflow.testing.browser import console_errors, screenshot, text

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
    run_to_end(
        client,
        DAG,
        {"nodes": 2, "steps": 60, "checkpoint_interval": 20, "tenant": "e2e", "heartbeat_interval": 0.2},
        RUN,
        600,
    )  # a few loss points even when fast
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
    assert row["goodput"] > 0.9  # no fault: only the logging between steps is not training
    assert (row["allocation"]["pool"], row["allocation"]["held"]) == ("embedded", 0) and row["allocation"]["released"]

    status, body = get(stack, f"/trainflow/api/runs/e2e/{DAG}/{RUN}", finished)
    assert status == 200, body
    d = json.loads(body)
    assert [r["state"] for r in d["ranks"]] == ["done", "done"]
    agents = d["node_agents"]
    assert [(n["node"], n["state"], n["task_state"]) for n in agents] == [
        (0, "succeeded", "success"),
        (1, "succeeded", "success"),
    ]
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


# --- The page in a real browser: Debian's headless Chromium driven by Selenium ---------------
LIVE = "e2e-page-live"
SHOT = "training-page-timeout.png"


def wait_for(driver, predicate, timeout: float, what: str):
    return browser_tools.wait_for(driver, predicate, timeout, what, SHOT)


@pytest.mark.browser
def test_in_a_browser_sign_in_see_a_live_and_a_finished_run(stack, client, finished, browser):
    from selenium.webdriver.common.by import By

    # A run that trains long enough to be watched live (cancelled when seen).
    client.trigger(DAG, {"nodes": 2, "steps": 100000, "checkpoint_interval": 2000, "tenant": "e2e"}, run_id=LIVE)

    # Sign in the way a person does: the page sends a signed-out browser to Airflow's login
    # form, which brings it back.
    browser.get(stack.url + "/trainflow")  # without the slash: redirected, not the UI's 404
    assert console_errors(browser, allowed=("401 (Unauthorized)",)) == []
    browser.find_element(By.LINK_TEXT, "sign in to Airflow").click()
    user, password = stack.credentials()
    wait_for(browser, lambda d: d.find_elements(By.NAME, "username"), 60, "the login form")
    browser.find_element(By.NAME, "username").send_keys(user)
    browser.find_element(By.NAME, "password").send_keys(password)
    browser.find_element(By.CSS_SELECTOR, "button[type=submit]").click()
    wait_for(
        browser,
        lambda d: d.current_url.rstrip("/").endswith("/trainflow") and d.find_elements(By.CSS_SELECTOR, "tr.run"),
        60,
        "the list of runs after signing in",
    )

    # The live run: its ranks report healthy heartbeats, refreshed without a reload. (Opened
    # once provision made its workspace: before that the API rightly answers 404.)
    deadline = time.monotonic() + 180
    while LIVE not in get(stack, "/trainflow/api/runs?tenant=e2e", finished)[1]:
        assert time.monotonic() < deadline, "the live run was never provisioned"
        time.sleep(1)
    browser.get(f"{stack.url}/trainflow/#e2e/{DAG}/{LIVE}")
    ranks = (
        "return [...document.querySelectorAll('#ranks tbody tr')].filter(r => r.cells.length > 4)"
        ".map(r => [r.cells[2].textContent, +r.cells[4].textContent])"
    )

    def live_steps(d) -> list[int]:
        """The live run's ranks' steps when all of them show healthy (else [])."""
        if LIVE not in text(d, "#detail h2"):
            return []
        rows = d.execute_script(ranks)
        return [s for _, s in rows] if rows and all(h == "healthy" for h, _ in rows) else []

    wait_for(
        browser,
        lambda d: len(steps := live_steps(d)) == 2 and min(steps) > 0,
        300,
        "the live run's two healthy, training ranks",
    )
    # Per node, as a person reads it: the agent's state, its task's state in Airflow, its host,
    # the try within the run's retry budget and the tries left, then the host's cordon (a
    # shared host's: not asserted).
    nodes = browser.execute_script(
        "return [...document.querySelectorAll('#nodes tbody tr')].map(r => [...r.cells].map(c => c.textContent.trim()))"
    )
    assert [n[0] for n in nodes] == ["0", "1"], nodes
    for _, agent, task, host, try_, left, *_ in nodes:
        assert (agent, task) == ("running", "running") and host and try_ == "1" and left.isdigit(), nodes
    first = min(live_steps(browser) or [0])
    wait_for(
        browser, lambda d: min(live_steps(d) or [0]) > first, 60, "the live run's steps advancing without a reload"
    )
    screenshot(browser, "training-page-live.png")
    links = browser.execute_script("return [...document.querySelectorAll('#tasks a')].map(a => a.href)")
    assert f"{stack.url}/dags/{DAG}/runs/{LIVE}/tasks/shard_train/mapped/1" in links
    assert console_errors(browser) == []

    # The finished run: its loss chart, verified checkpoints and evaluation.
    wait_for(
        browser,
        lambda d: d.find_element(By.CSS_SELECTOR, f'tr.run[data-key="e2e/{DAG}/{RUN}"]').click() or True,
        10,
        "the finished run's row",
    )
    wait_for(
        browser, lambda d: RUN in text(d, "#detail h2") and "completed" in text(d, "#detail h2"), 30, "the finished run"
    )
    path = browser.execute_script(
        "return document.querySelector('svg[aria-label=\"training loss by step\"] path').getAttribute('d')"
    )
    # The loss chart: one point per recorded loss (one per heartbeat interval: how many a
    # 60-step run records depends on the machine's speed, so compare with the API's curve).
    curve = json.loads(get(stack, f"/trainflow/api/runs/e2e/{DAG}/{RUN}", finished)[1])["loss_curve"]
    assert len(curve) >= 2 and path.startswith("M") and path.count("L") == len(curve) - 1, (path, curve)
    detail = text(browser, "#detail")
    assert "released (embedded)" in text(browser, f'tr.run[data-key="e2e/{DAG}/{RUN}"]')
    assert "verified" in detail and "accuracy" in detail and "No faults." in detail
    screenshot(browser, "training-page-finished.png")
    assert console_errors(browser) == []

    # Done watching: cancel the live run the way the CLI does (its tasks failed, no retry).
    from trainflow.cli_runs import cmd_cancel

    assert cmd_cancel(client, argparse.Namespace(dag=DAG, run_id=LIVE)) == 0
    assert client.wait_run(DAG, LIVE, timeout=180)["state"] == "failed"
