"""The house rules that tools hold, not memory: layers and lint (ruff, with the banned-api
rules in pyproject.toml and trainflow/sched/ruff.toml), formatting, the documentation site
building with no broken link, and prose for users rather than a lab notebook."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
README_LIMIT = 12 * 1024
# Development history belongs in git log, not in what users read.
HISTORY = re.compile(r"\b(this session|session \d+|earlier runs?|issue #?\d+|DESIGN\.md)\b", re.IGNORECASE)


def _tool(module: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, capture_output=True, text=True, timeout=300)


def _prose() -> list[Path]:
    return [REPO / "README.md", REPO / "CONTRIBUTING.md", *sorted((REPO / "docs").rglob("*.md"))]


def test_lint_and_layers_hold():
    """``ruff check``: pyflakes, pycodestyle, import order, and the layers — the core never
    imports airflow, the scheduling policies never import the cluster package."""
    result = _tool("ruff", "check", "--no-cache", ".")
    assert result.returncode == 0, f"ruff check failed (fix, or `ruff check --fix .`):\n{result.stdout}{result.stderr}"


def test_code_is_formatted():
    result = _tool("ruff", "format", "--check", "--no-cache", ".")
    assert result.returncode == 0, f"run `ruff format .`:\n{result.stdout}{result.stderr}"


def test_the_docs_site_builds_with_no_broken_link(tmp_path):
    """MkDocs in strict mode: a link to a missing page or anchor, or a page left out of the
    navigation, fails the build."""
    result = _tool("mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site"))
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stdout}{result.stderr}"


@pytest.mark.parametrize("name", ["README.md", "CONTRIBUTING.md"])
def test_top_level_links_resolve(name):
    """The pages outside the site (MkDocs does not check them)."""
    text = (REPO / name).read_text()
    broken = []
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if "://" in target or target.startswith("mailto:"):
            continue
        if not (REPO / target).exists():
            broken.append(target)
    assert not broken, f"{name} links to missing files: {broken}"


def test_the_readme_is_short():
    size = len((REPO / "README.md").read_bytes())
    assert size <= README_LIMIT, f"README.md is {size} bytes; keep it ≤ {README_LIMIT} and move detail to docs/"


def test_prose_carries_no_development_history():
    found = [
        f"{path.relative_to(REPO)}:{n}: {m.group(0)}"
        for path in _prose()
        for n, line in enumerate(path.read_text().splitlines(), 1)
        for m in [HISTORY.search(line)]
        if m
    ]
    assert not found, "history belongs in git log:\n" + "\n".join(found)


def test_the_airflow_side_of_a_run_loads_no_torch(tmp_path):
    """Provision, a node task's preflight and the watch run in Airflow's task processes,
    once per run and per try: none of them needs torch, which costs seconds of CPU to load
    and hundreds of MiB per process (only the agents, the workers and evaluate do)."""
    code = f"""
import sys
from pathlib import Path
import operators.provision, operators.shard_train, operators.checkpoint_sync, sensors.heartbeat
from trainflow import preflight
from trainflow.launch.local import prepare
from operators._common import load_plan
from trainflow.spec import TrainingSpec

plan = load_plan(prepare(TrainingSpec(), Path({str(tmp_path)!r}) / "run").parent)
check = preflight.rendezvous_reachable(plan["rendezvous"]["endpoint"], backend=plan["rendezvous"]["backend"])
assert check.ok, check
loaded = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
print(loaded[:5])
sys.exit(1 if loaded else 0)
"""
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "AIRFLOW_HOME": str(tmp_path / "airflow"),
        "TRAINFLOW_HOME": str(tmp_path / "trainflow"),
    }
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300, env=env
    )
    assert result.returncode == 0, f"torch loaded: {result.stdout}{result.stderr[-2000:]}"
