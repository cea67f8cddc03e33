from __future__ import annotations

import pytest

from trainflow.errors import SpecError
from trainflow.spec import TrainingSpec, param_schema


def test_defaults_are_valid_and_derived_sizes():
    spec = TrainingSpec(nodes=3, nproc_per_node=2, batch_size=8)
    assert spec.world_size == 6
    assert spec.global_batch_size == 48


@pytest.mark.parametrize(
    "conf, field, fix",
    [
        ({"nodes": 0}, "nodes", "use a number of nodes (1..64)"),
        ({"nodes": -3}, "nodes", "use a number of nodes"),
        ({"nodes": "4:2"}, "nodes", "with min ≤ max"),
        ({"nodes": "2-4"}, "nodes", "'min:max'"),
        ({"nodes": "0:3"}, "nodes", "use a number of nodes"),
        ({"batch_policy": "grow"}, "batch_policy", "keep_global"),
        ({"chip": "tpu"}, "chip", "ascend"),
        ({"workload": "nosuch"}, "workload", "package.module:build"),
        ({"steps": 0}, "steps", "≥ 1"),
        ({"lr": 0.0}, "lr", "> 0"),
        ({"lr": -1e-3}, "lr", "> 0"),
        ({"steps": 10, "checkpoint_interval": 20}, "checkpoint_interval", "at most steps"),
        ({"tenant": "../etc"}, "tenant", "must match"),
        ({"tenant": "a/b"}, "tenant", "must match"),
        ({"strategy": "zero3"}, "strategy", "ddp"),
        ({"nodes": True}, "nodes", "use a number of nodes"),
        ({"lr": float("nan")}, "lr", "finite"),
        ({"store_uri": "file:///tmp/../etc"}, "store_uri", ".."),
        ({"bogus": 1}, "bogus", "unknown field"),
    ],
    ids=lambda v: str(v)[:30],
)
def test_bad_input_names_field_value_and_fix(conf, field, fix):
    with pytest.raises(SpecError) as info:
        TrainingSpec.from_mapping(conf)
    assert info.value.field == field
    assert fix in str(info.value)
    assert repr(next(iter(conf.values())))[:10] in str(info.value) or field == "checkpoint_interval"


def test_elastic_nodes_and_batch_policy():
    spec = TrainingSpec(nodes="2:4", nproc_per_node=2, batch_size=8, spares=1)
    assert (spec.min_nodes, spec.max_nodes, spec.elastic) == (2, 4, True)
    assert (spec.world_size, spec.min_world_size, spec.global_batch_size) == (8, 4, 64)
    assert spec.global_batch_at(4) == 64 and spec.global_batch_at(6) == 64  # keep_global
    per_rank = TrainingSpec(nodes="2:4", batch_size=8, batch_policy="keep_per_rank")
    assert per_rank.global_batch_at(3) == 24
    assert per_rank.training_hash() != TrainingSpec(nodes="2:4", batch_size=8).training_hash()
    for fixed in (3, "3", "3:3"):
        spec = TrainingSpec(nodes=fixed)
        assert spec.nodes == 3 and not spec.elastic and spec.world_size == 3
    assert TrainingSpec.from_json(TrainingSpec(nodes="1:3").to_json()).nodes == "1:3"
    # the elastic fields do not change the training hash of fixed-size runs
    assert TrainingSpec(nodes=2).training_hash() == TrainingSpec(nodes="2:4", spares=2).training_hash()


def test_json_round_trip_and_number_coercion():
    spec = TrainingSpec.from_mapping({"lr": 1, "steps": 40.0, "checkpoint_interval": 10})
    assert spec.lr == 1.0 and isinstance(spec.lr, float)
    assert spec.steps == 40 and isinstance(spec.steps, int)
    assert TrainingSpec.from_json(spec.to_json()) == spec


def test_training_hash_ignores_operational_fields():
    a = TrainingSpec()
    assert a.training_hash() == TrainingSpec(heartbeat_interval=2.0, retries=5, tenant="x").training_hash()
    assert a.training_hash() != TrainingSpec(seed=1).training_hash()


def test_param_schema_mirrors_spec_rules():
    schema = param_schema({"workload": "tinylm", "steps": 1000})
    assert schema["workload"]["default"] == "tinylm"
    assert schema["steps"] == {**schema["steps"], "type": "integer", "minimum": 1, "default": 1000}
    assert schema["lr"]["type"] == "number" and schema["lr"]["exclusiveMinimum"] == 0
    assert "nvidia" in schema["chip"]["enum"]
    assert schema["tenant"]["pattern"].startswith("^")
    assert set(schema) == {f for f in TrainingSpec.__dataclass_fields__}


def test_param_schema_rejects_bad_dag_defaults():
    with pytest.raises(SpecError):
        param_schema({"nodes": 0})


def test_elastic_gangs_need_a_heartbeat_timeout_beyond_the_shrink_grace():
    with pytest.raises(SpecError, match="shrink_grace \\+ 10 s \\(40\\)"):
        TrainingSpec(nodes="2:3", shrink_grace=30, heartbeat_timeout=35)
    TrainingSpec(nodes="2:3", shrink_grace=30, heartbeat_timeout=40)
    TrainingSpec(nodes=3, shrink_grace=30, heartbeat_timeout=35)  # fixed size: no shrinking


@pytest.mark.parametrize(
    "kw, field", [({"nodes": "1:2"}, "nodes"), ({"spares": 1}, "spares"), ({"launcher": "kubernetes"}, "launcher")]
)
def test_preemptible_needs_a_fixed_gang_without_spares_on_the_local_launcher(kw, field):
    with pytest.raises(SpecError, match=f"invalid {field}.*preemptible run is a fixed-size gang"):
        TrainingSpec(preemptible=True, **kw)
    spec = TrainingSpec(preemptible=True, nodes=2)
    assert spec.preemptible and spec.training_hash() == TrainingSpec(nodes=2).training_hash()
