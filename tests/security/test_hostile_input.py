"""Untrusted input: property-based tests (hypothesis) over the spec parser, the Param schema
the trigger form and REST conf are checked with, and every name that becomes a path or an
S3 key. No input crashes the parser with anything but a ``SpecError`` naming a field, no
accepted spec is refused by the schema, and no name escapes its workspace or prefix."""

from __future__ import annotations

import os
from pathlib import Path

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trainflow.checkpoint.s3 import S3Store
from trainflow.checkpoint.store import durable_root
from trainflow.errors import CheckpointError, SpecError
from trainflow.spec import TrainingSpec, param_schema
from trainflow.workspace import Workspace

FIELDS = sorted(param_schema())
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**63) | st.floats(allow_nan=True) | st.text(max_size=40),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=8,
)
hostile_text = st.one_of(
    st.text(max_size=60),
    st.sampled_from(
        [
            "..",
            "../x",
            "a/../../b",
            "/etc/passwd",
            "%2e%2e%2f",
            "a\x00b",
            "/\x00",
            "a/b",
            ".",
            "~root",
            "..\\..\\x",
            "a\nb",
            " ",
            "CON",
            "é",
            "a" * 300,
        ]
    ),
)
conf = st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=12), json_values | hostile_text, max_size=8)
SCHEMA = {
    "type": "object",
    "properties": {
        name: {k: v for k, v in kw.items() if k not in ("default", "title", "description")}
        for name, kw in param_schema().items()
    },
}
# Derandomized: the same 400 examples in every run (CI stays deterministic); change the
# seed locally to explore further.
PROFILE = settings(
    max_examples=400, deadline=None, database=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)


@PROFILE
@given(conf)
def test_any_conf_parses_or_is_refused_naming_a_field(data):
    try:
        spec = TrainingSpec.from_mapping(data)
    except SpecError as exc:
        assert exc.field and str(exc).startswith("invalid ")
        return
    # What the parser accepts, the trigger form's schema accepts too.
    jsonschema.validate(spec.to_dict() if hasattr(spec, "to_dict") else dict(data), SCHEMA)


@PROFILE
@given(st.sampled_from(FIELDS), json_values | hostile_text)
def test_one_bad_field_is_refused_by_name(field, value):
    try:
        TrainingSpec.from_mapping({field: value})
    except SpecError as exc:
        assert exc.field.split("[")[0].split(".")[0] in FIELDS or exc.field == field


@PROFILE
@given(hostile_text, hostile_text, hostile_text)
def test_workspace_names_never_escape_the_root(tenant, dag_id, run_id):
    root = Path("/tmp/tf-security-root")
    try:
        ws = Workspace(root, tenant, dag_id, run_id)
    except SpecError:
        return
    assert root.resolve() in ws.dir.resolve().parents
    assert "\x00" not in str(ws.dir) and ".." not in ws.dir.relative_to(root.resolve()).parts


@PROFILE
@given(hostile_text, hostile_text, hostile_text, hostile_text)
def test_s3_keys_never_leave_the_prefix(prefix, tenant, dag_id, run_id):
    try:
        store = S3Store(object(), "bucket", prefix, tenant=tenant, dag_id=dag_id, run_id=run_id)
    except (SpecError, CheckpointError):
        return
    key = store._key(7, "__0_0.distcp")
    parts = key.split("/")
    assert ".." not in parts and "." not in parts and "" not in parts and "\x00" not in key
    assert key.startswith(store.root + "/step-00000007/")


@PROFILE
@given(hostile_text)
def test_file_store_uris_stay_in_their_directory(path):
    uri = "file://" + path
    try:
        root = durable_root(uri, "tenant", "dag", "run")
    except (SpecError, CheckpointError):
        return
    assert root.name == "checkpoints" and ".." not in root.parts


def test_a_symlink_out_of_the_root_is_refused(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    root = tmp_path / "root"
    root.mkdir()
    os.symlink(outside, root / "evil")  # a tenant directory that points elsewhere
    with pytest.raises(SpecError, match="resolves outside the workspace root"):
        Workspace(root, "evil", "dag", "run")


@pytest.mark.parametrize("run_id", ["../other", "a/b", "x\x00y", "..", "%2e%2e", "/abs"])
def test_hostile_run_ids_are_refused(run_id, tmp_path):
    with pytest.raises(SpecError):
        Workspace(tmp_path, "tenant", "dag", run_id)
