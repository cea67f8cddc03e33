from __future__ import annotations

import os
import socket
import tempfile
import time
from collections import defaultdict
from pathlib import Path

os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
# The test stacks never see a DAG file change, and the suite is CPU-bound on two cores: an
# idle embedded stack costs 13.5 % of a core (measured), 10.5 % re-parsing the DAG files
# every 5 minutes instead of 30 s, 7.2 % with the scheduler idling 0.5 s instead of 0.25 s
# between empty loops (a task transition waits up to 0.25 s longer). Two to four stacks are
# up through the e2e phase.
os.environ.setdefault("AIRFLOW__DAG_PROCESSOR__MIN_FILE_PROCESS_INTERVAL", "300")
os.environ.setdefault("AIRFLOW__SCHEDULER__SCHEDULER_IDLE_SLEEP_TIME", "0.5")

import pytest  # noqa: E402

# -- tiers ----------------------------------------------------------------------------------
# Every test belongs to exactly one tier (a pytest marker, declared in pyproject.toml):
#   unit         no services, no Airflow stack, no torch.distributed world; the inner loop
#   integration  PostgreSQL, Redis, the S3 server, real torch.distributed, real processes
#   e2e          real Airflow stacks
#   browser      headless Chromium against a real stack
# A test's tier is its folder's (tests/integration, tests/e2e), unless it is marked
# explicitly, or (outside those folders) it uses a fixture that needs a service.
TIERS = ("unit", "integration", "e2e", "browser")
SERVICE_FIXTURES = frozenset({"pg_url", "postgres", "s3_server"})


def _tier_of(item) -> str:
    explicit = [t for t in TIERS if item.get_closest_marker(t) is not None]
    if "browser" in explicit:
        return "browser"
    path = item.nodeid.split("::", 1)[0]
    if path.startswith("tests/e2e/") or "e2e" in explicit:
        return "e2e"
    if path.startswith("tests/integration/") or "integration" in explicit:
        return "integration"
    names = set(getattr(item, "fixturenames", ()))
    if names & SERVICE_FIXTURES:
        return "integration"
    callspec = getattr(item, "callspec", None)
    if "state_target" in names and callspec is not None and callspec.params.get("state_target") == "postgres":
        return "integration"
    return "unit"


# The suite runs on two pytest-xdist workers, a file at a time (scripts/test: -n 2 --dist
# loadfile --no-loadscope-reorder), handed out in collection order (xdist would otherwise
# hand out the files with the most tests first): the e2e files first (so each worker's
# shared stack can stop once they are done), and within each group the longest files first
# so that neither worker is left with a long one at the end (the tinylm run of
# test_resume.py once trained alone for six minutes while the other worker idled).
LONGEST_FIRST = (
    "e2e/test_chaos.py",
    "e2e/test_distributed_stack.py",
    "e2e/test_programs.py",
    "e2e/test_outside_chaos.py",
    "e2e/test_airflow_controls.py",
    "e2e/test_elastic_gangs.py",
    "e2e/test_soak.py",
    "integration/test_resume.py",
    "e2e/test_embedded_stack.py",
    "integration/test_faults.py",
    "integration/test_program.py",
    "integration/test_bench_smoke.py",
    "integration/test_elastic.py",
)


# The benchmark smokes that take minutes (most start an Airflow stack of their own) run when
# asked: the suite's 30 minutes cannot hold them yet.
LONG_SMOKES = os.environ.get("TRAINFLOW_LONG_SMOKES") == "1"


def pytest_collection_modifyitems(session, config, items):
    for item in items:
        tier = _tier_of(item)  # a file mixing tiers marks its tests one by one, not its module
        item.add_marker(getattr(pytest.mark, tier))
        item.user_properties.append(("tier", tier))
        if item.get_closest_marker("long_smoke") is not None and not LONG_SMOKES:
            item.add_marker(pytest.mark.skip(reason="a benchmark smoke of minutes: TRAINFLOW_LONG_SMOKES=1 runs it"))

    def rank(item) -> tuple[int, int]:
        path = item.nodeid.split("::", 1)[0]
        stacks = 0 if path.startswith("tests/e2e/") else 1  # every Airflow stack's files first
        return stacks, next((i for i, name in enumerate(LONGEST_FIRST) if path.endswith(name)), len(LONGEST_FIRST))

    items.sort(key=rank)  # stable: the order within a file and among the rest is kept


def pytest_runtest_setup(item):
    """A worker that has moved on from the e2e files stops the shared Airflow stack it
    started (an idle scheduler, dag-processor and triggerer cost ~13 % of a core); an e2e
    file handed to it later starts the stack again."""
    if dict(item.user_properties).get("tier") in ("unit", "integration"):
        for stack in getattr(item.config, "trainflow_idle_stacks", ()):
            stack.stop()  # a no-op once stopped: no component left to signal


# -- services: skipped with the reason where absent, an error on CI -------------------------
def _reachable(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=2):
            return True
    except OSError:
        return False


def need_service(name: str, host: str, port: int) -> None:
    """Skip the test (saying why) when ``name`` does not answer on ``host:port``; on CI
    (``CI`` set) a missing service is an error instead: CI must run every tier."""
    if _reachable(host, port):
        return
    message = f"{name} is not reachable on {host}:{port}"
    if os.environ.get("CI"):
        pytest.fail(f"{message} (CI runs every tier: start it in .ci/run)", pytrace=False)
    pytest.skip(f"{message}: start it to run this test (CI does)")


# -- growth made visible: tier totals and Airflow stack starts ------------------------------
_STACK_LOG_ENV = "TRAINFLOW_TEST_STACK_STARTS"


_TOTALS: dict[str, dict[str, float]] = defaultdict(
    lambda: {"tests": 0, "passed": 0, "failed": 0, "skipped": 0, "seconds": 0.0}
)
_T0 = time.monotonic()


def pytest_configure(config):
    if not os.environ.get(_STACK_LOG_ENV):  # the controller; xdist workers inherit it
        fd, path = tempfile.mkstemp(prefix="tf-stack-starts-", suffix=".log")
        os.close(fd)
        os.environ[_STACK_LOG_ENV] = path


@pytest.fixture(autouse=True, scope="session")
def _count_stack_starts():
    """Each ``EmbeddedStack.up`` of the session appends a line to a file the controller sums."""
    from trainflow.stack import EmbeddedStack

    original = EmbeddedStack.up

    def up(self, *args, **kwargs):
        with open(os.environ[_STACK_LOG_ENV], "a") as log:
            log.write(f"{self.home}\n")
        return original(self, *args, **kwargs)

    EmbeddedStack.up = up
    yield
    EmbeddedStack.up = original


def pytest_runtest_logreport(report):
    """Tier totals (on the controller, xdist hands it every worker's reports)."""
    totals = _TOTALS[dict(report.user_properties).get("tier", "unit")]
    totals["seconds"] += report.duration
    if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
        totals["tests"] += 1
        totals[report.outcome] += 1
    elif report.when == "teardown" and report.outcome == "failed":
        totals["failed"] += 1


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if hasattr(config, "workerinput") or not any(t["tests"] for t in _TOTALS.values()):
        return
    tr = terminalreporter
    tr.section("tiers")
    for tier in TIERS:
        t = _TOTALS.get(tier)
        if t and t["tests"]:
            tr.write_line(
                f"{tier:12s} {t['tests']:5d} tests  {t['passed']:5d} passed  {t['failed']:3d} failed  "
                f"{t['skipped']:3d} skipped  {t['seconds'] / 60:6.1f} min of test time"
            )
    path = Path(os.environ.get(_STACK_LOG_ENV, ""))
    starts = len(path.read_text().splitlines()) if path.is_file() else 0
    tr.write_line(f"Airflow stack starts: {starts}; wall {(time.monotonic() - _T0) / 60:.1f} min")


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """A real S3 server (SeaweedFS ``weed mini``) on loopback for the whole session: it
    stores on disk, checks SigV4 credentials and SHA-256 checksums."""
    from trainflow.testing.seaweed import SeaweedS3

    server = SeaweedS3(tmp_path_factory.mktemp("seaweed")).start()
    yield server
    server.stop()


PG_ADMIN = "postgresql://postgres@127.0.0.1:5432/postgres"


@pytest.fixture
def postgres():
    """The machine's PostgreSQL server (5432, trust) answers: the test skips, saying why,
    where it does not (on CI it fails: CI runs every tier)."""
    need_service("PostgreSQL", "127.0.0.1", 5432)
    return PG_ADMIN


@pytest.fixture
def pg_url():
    """A fresh PostgreSQL database on the machine's server (5432, trust), dropped after."""
    import uuid

    import psycopg2

    need_service("PostgreSQL", "127.0.0.1", 5432)
    name = f"tf_test_{uuid.uuid4().hex[:12]}"
    admin = psycopg2.connect(PG_ADMIN)
    admin.autocommit = True
    admin.cursor().execute(f"CREATE DATABASE {name}")
    try:
        yield f"postgresql://postgres@127.0.0.1:5432/{name}"
    finally:
        admin.cursor().execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        admin.close()


@pytest.fixture(params=["sqlite", "postgres"])
def state_target(request, tmp_path):
    """trainflow's state database, of each kind (embedded SQLite, distributed PostgreSQL)."""
    if request.param == "sqlite":
        return tmp_path / "state.db"
    return request.getfixturevalue("pg_url")


def load_bench(name: str):
    """``bench/<name>.py`` as a module (tests run the benchmarks' own code)."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "bench" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"bench_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def soak_bench():
    """``bench/soak.py`` as a module (its smoke run in the suite and the unit tests of its
    verdicts run the benchmark's own code)."""
    return load_bench("soak")
