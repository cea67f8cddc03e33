"""A real browser for the browser tier: Debian's headless Chromium driven by Selenium.

The closed network here needs Chromium's background networking off (it keeps trying
Google's hosts otherwise) and Selenium Manager offline (it would try to download a driver);
``--no-sandbox`` because the tests run as root.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable

CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")
# Where screenshots go: a test artifact CI keeps (the path is printed too).
ARTIFACTS = Path(os.environ.get("TRAINFLOW_TEST_ARTIFACTS", "test-artifacts"))


def available() -> bool:
    return bool(CHROMIUM and CHROMEDRIVER)


def chrome(user_data_dir: Path):
    """A headless Chromium session (the caller quits it)."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    os.environ.setdefault("SE_OFFLINE", "true")
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-dev-shm-usage",
        "--window-size=1400,2200",
        f"--user-data-dir={user_data_dir}",
    ):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    driver.set_page_load_timeout(60)
    return driver


def console_errors(driver, allowed: tuple[str, ...] = ()) -> list[dict]:
    """The browser console's SEVERE entries since the last call (reading empties the log)."""
    return [
        e for e in driver.get_log("browser") if e["level"] == "SEVERE" and not any(a in e["message"] for a in allowed)
    ]


def text(driver, selector: str) -> str:
    """The element's visible text, read in one script call (no element handle to go stale)."""
    return driver.execute_script(f"return document.querySelector({json.dumps(selector)})?.innerText || ''")


def screenshot(driver, name: str) -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / name
    driver.save_screenshot(str(path))
    return path


def wait_for(driver, predicate: Callable[[Any], Any], timeout: float, what: str, shot: str = "timeout.png"):
    """``predicate(driver)``'s first truthy value within ``timeout`` s; else an AssertionError
    naming ``what``, with a screenshot and the page's text."""
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.support.ui import WebDriverWait

    try:  # pages re-render: a found element may go stale, look again
        return WebDriverWait(
            driver, timeout, poll_frequency=0.25, ignored_exceptions=(StaleElementReferenceException,)
        ).until(lambda d: predicate(d))
    except Exception as exc:  # selenium's TimeoutException: say what did not appear
        path = screenshot(driver, shot)
        raise AssertionError(
            f"{what} not shown within {timeout} s (screenshot {path})\n"
            f"{driver.find_element('tag name', 'body').text[:3000]}"
        ) from exc


def sign_in(driver, base_url: str, user: str, password: str, *, then: str = "/") -> None:
    """Sign in through Airflow's own login form, as a person does, then open ``then``."""
    from selenium.webdriver.common.by import By

    driver.get(f"{base_url}/auth/login?next={base_url}{then}")
    wait_for(driver, lambda d: d.find_elements(By.NAME, "username"), 60, "the login form")
    driver.find_element(By.NAME, "username").send_keys(user)
    driver.find_element(By.NAME, "password").send_keys(password)
    driver.find_element(By.CSS_SELECTOR, "button[type=submit]").click()
    wait_for(driver, lambda d: "/auth/login" not in d.current_url, 60, "the page after signing in")
