"""Airflow's trigger form for a training DAG, used by a person in a real browser: with its
defaults the Trigger button is enabled and starts the default run, which trains to the end;
a bad value (0 nodes) is refused by name, and no run is created."""

from __future__ import annotations

import pytest

from trainflow.testing import browser as tools

pytestmark = pytest.mark.browser
DAG = "train_digits"
DIALOG = "[role=dialog][aria-modal=true]"  # not the page's hidden popovers, also dialogs


def open_trigger_form(driver, stack):
    from selenium.webdriver.common.by import By

    driver.get(f"{stack.url}/dags/{DAG}")
    tools.wait_for(
        driver,
        lambda d: d.find_elements(By.CSS_SELECTOR, "button[aria-label='Trigger Dag']"),
        60,
        "the DAG page's Trigger button",
        "trigger-form-timeout.png",
    )[0].click()
    tools.wait_for(
        driver, lambda d: "Run Parameters" in tools.text(d, DIALOG), 60, "the trigger form", "trigger-form-timeout.png"
    )


def form_button(driver, label: str):
    """The trigger form's button or section header labelled ``label``."""
    from selenium.webdriver.common.by import By

    return [b for b in driver.find_elements(By.CSS_SELECTOR, f"{DIALOG} button") if b.text.strip() == label][-1]


def set_field(driver, name: str, value: str) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    field = driver.find_element(By.ID, f"element_{name}")
    field.send_keys(Keys.CONTROL + "a", Keys.DELETE)
    field.send_keys(value)


def test_the_default_run_starts_from_the_form_and_a_bad_value_is_refused(stack, client, browser):
    client.wait_for_dag(DAG, timeout=180)
    user, password = stack.credentials()
    tools.sign_in(browser, stack.url, user, password)
    before = {r["dag_run_id"] for r in client.runs(DAG)}

    # 0 nodes: typed into the one-line Nodes field (section Gang), refused by name on Trigger.
    open_trigger_form(browser, stack)
    assert "required" not in tools.text(browser, DIALOG).lower()
    form_button(browser, "Gang").click()
    set_field(browser, "nodes", "0")
    form_button(browser, "Trigger").click()
    tools.wait_for(
        browser,
        lambda d: "Invalid input for param nodes" in tools.text(d, DIALOG),
        30,
        "the form's refusal of 0 nodes",
        "trigger-form-refused.png",
    )
    assert {r["dag_run_id"] for r in client.runs(DAG)} == before
    tools.screenshot(browser, "trigger-form-refused.png")

    # The form as it opens: every section present, Trigger enabled, pressed: the default run.
    open_trigger_form(browser, stack)
    for section in ("Gang", "Chip", "Optimisation", "Checkpoints", "Health", "Scheduling", "Rehearsal faults"):
        assert form_button(browser, section)
    trigger = form_button(browser, "Trigger")
    assert trigger.is_enabled()
    trigger.click()
    new = tools.wait_for(
        browser,
        lambda d: [r for r in client.runs(DAG) if r["dag_run_id"] not in before],
        60,
        "the run the form triggered",
        "trigger-form-started.png",
    )
    (run,) = new
    assert run["conf"]["nodes"] == "2" and run["conf"]["store_uri"] is None, run["conf"]
    done = client.wait_run(DAG, run["dag_run_id"], timeout=600)
    states = {(t["task_id"], t["map_index"]): t["state"] for t in client.task_instances(DAG, run["dag_run_id"])}
    assert done["state"] == "success", states
    assert client.xcom(DAG, run["dag_run_id"], "evaluate", "metrics")["step"] == 300
