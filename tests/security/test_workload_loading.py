"""Workloads load only from the module prefixes configuration allows: a conf naming any
other module (``os:system``, a look-alike prefix) is refused before it is imported."""

from __future__ import annotations

import sys

import pytest

from trainflow.errors import SpecError
from trainflow.workloads.base import resolve


@pytest.mark.parametrize(
    "name",
    [
        "os:system",
        "subprocess:run",
        "builtins:eval",
        "trainflow.workloadsX.evil:build",
        "workloads_evil:build",
        "tests.security.evil_module:build",
    ],
)
def test_modules_outside_the_allowed_prefixes_are_refused_unimported(name, monkeypatch):
    monkeypatch.delenv("TRAINFLOW_WORKLOAD_MODULES", raising=False)
    module = name.split(":")[0]
    was_loaded = module in sys.modules
    with pytest.raises(SpecError, match="module not allowed; add its package to TRAINFLOW_WORKLOAD_MODULES"):
        resolve(name)
    assert (module in sys.modules) == was_loaded  # never imported by the attempt


def test_configuration_decides_what_is_allowed(monkeypatch):
    monkeypatch.setenv("TRAINFLOW_WORKLOAD_MODULES", "json")
    assert resolve("json:dumps")({"a": 1}) == '{"a": 1}'
    with pytest.raises(SpecError, match="module not allowed"):
        resolve("trainflow.workloads.tinylm:build")  # not listed any more
