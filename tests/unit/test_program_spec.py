"""The user's program in the spec: validation (field, value, fix), placeholders, the allowed
places, the SDK outside a run, and the checkpoint identity evaluate gives programs."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys

import pytest

from trainflow.errors import SpecError
from trainflow.program import check_place, resolve
from trainflow.spec import TrainingSpec, param_schema

GOOD = ["python", "-m", "trainflow.worker.train", "--out", "{checkpoint_dir}", "--resume", "{resume_from}"]


@pytest.mark.parametrize(
    "kw,field,fix",
    [
        (dict(program="python train.py"), "program", "never a shell string"),
        (dict(program=["python", "-m", "a.b", "{nope}"]), "program[3]", "unknown placeholder {nope}"),
        (dict(program=["python", "-m", "a.b", "{checkpoint_dir!r}"]), "program[3]", "plain names"),
        (dict(program=["python", "-m", "a.b", "{"]), "program[3]", "literal brace"),
        (dict(program=["python", "-m", "a.b", "x\x00y"]), "program[3]", "NUL"),
        (dict(program=["python", "-m", "a.b", 3]), "program[3]", "every argument is a string"),
        (dict(program=["python", "-m", "a.b", *["x"] * 300]), "program", "at most 256"),
        (dict(program=["python"]), "program", "'-m package.module' or a script"),
        (dict(program=["python", "-m", "not a module"]), "program", "module name"),
        (dict(program=GOOD, program_env={"RANK": "3"}), "program_env.RANK", "set by trainflow's launch"),
        (dict(program=GOOD, program_env={"TRAINFLOW_X": "1"}), "program_env.TRAINFLOW_X", "remove it"),
        (dict(program=GOOD, program_env={"1BAD": "1"}), "program_env", "letters, digits"),
        (dict(program=GOOD, program_env={"OK": 3}), "program_env.OK", "a string"),
        (dict(program=GOOD, working_dir="relative/dir"), "working_dir", "absolute path"),
    ],
)
def test_bad_programs_are_refused_naming_field_value_and_fix(kw, field, fix):
    with pytest.raises(SpecError) as info:
        TrainingSpec(**kw)
    assert info.value.field == field and fix in str(info.value)


def test_a_program_round_trips_and_changes_the_training_hash_not_the_builtin_one():
    spec = TrainingSpec(program=GOOD, program_env={"MY_SETTING": "1"})
    again = TrainingSpec.from_json(spec.to_json())
    assert again.program == tuple(GOOD) and again.program_env == {"MY_SETTING": "1"}
    assert spec.training_hash() != TrainingSpec().training_hash()
    assert spec.training_hash() != TrainingSpec(program=GOOD).training_hash()  # its environment counts
    assert TrainingSpec(program=(), heartbeat_interval=2.0).training_hash() == TrainingSpec().training_hash()
    schema = param_schema()
    assert schema["program"]["type"] == "array" and schema["program"]["default"] == []
    assert schema["program_env"]["type"] == "object" and schema["program"]["section"] == "Program"


def test_placeholders_resolve_and_python_is_the_workers_interpreter():
    argv = resolve(
        GOOD + ["{{literal}}", "run={run_id}/{attempt}"],
        {"checkpoint_dir": "/c", "resume_from": "", "run_id": "r1", "attempt": "2"},
    )
    assert argv == [
        sys.executable,
        "-m",
        "trainflow.worker.train",
        "--out",
        "/c",
        "--resume",
        "",
        "{literal}",
        "run=r1/2",
    ]


def test_programs_run_only_from_allowed_modules_and_roots(tmp_path):
    env = {"TRAINFLOW_PROGRAM_MODULES": "trainflow.worker", "TRAINFLOW_PROGRAM_ROOTS": str(tmp_path / "ok")}
    assert check_place(GOOD, env=env) == "python -m trainflow.worker.train"
    with pytest.raises(SpecError, match="modules run from trainflow.worker only"):
        check_place(["python", "-m", "json.tool"], env=env)
    with pytest.raises(SpecError, match="no such module"):
        check_place(["python", "-m", "trainflow.worker.nothing_here"], env=env)
    (tmp_path / "ok").mkdir()
    script = tmp_path / "ok" / "train.py"
    script.write_text("print('hi')\n")
    assert check_place(["python", str(script)], env=env).endswith("train.py")
    with pytest.raises(SpecError, match="not executable"):
        check_place([str(script)], env=env)
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    assert check_place([str(script)], env=env) == str(script.resolve())
    outside = tmp_path / "elsewhere.py"
    outside.write_text("")
    with pytest.raises(SpecError, match="scripts run from TRAINFLOW_PROGRAM_ROOTS only"):
        check_place(["python", str(outside)], env=env)
    (tmp_path / "ok" / "link.py").symlink_to(outside)  # a link out of the root is outside it
    with pytest.raises(SpecError, match="TRAINFLOW_PROGRAM_ROOTS"):
        check_place(["python", str(tmp_path / "ok" / "link.py")], env=env)
    with pytest.raises(SpecError, match="no such file"):
        check_place(["python", str(tmp_path / "ok" / "missing.py")], env=env)
    with pytest.raises(SpecError, match="absolute path"):
        check_place(["python", "train.py"], env=env)


def test_the_sdk_imports_without_torch_or_airflow_and_does_nothing_outside_a_run():
    code = (
        "import sys; from trainflow import sdk; "
        "sdk.report(1, loss=0.5); assert not sdk.should_stop() and sdk.resume_from() is None; "
        "assert sdk.resume_step() == 0 and not sdk.active(); "
        "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'airflow', 'numpy')]; "
        "assert not bad, bad"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINFLOW_")}
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


def test_checkpoint_identity_is_the_saved_state_not_the_files_bytes(tmp_path):
    import torch

    from trainflow.checkpoint import manifest
    from trainflow.worker.evaluate import content_digest

    def saved(name, state):
        path = tmp_path / name
        torch.save(state, path)
        return content_digest(path, {"blake3": manifest.file_digest(path)})

    state = {"model": {"w": torch.arange(6.0).reshape(2, 3), "b": torch.tensor(0.5)}, "step": 3}
    a, b = saved("a.pt", state), saved("b.pt", state)
    assert (tmp_path / "a.pt").read_bytes() != (tmp_path / "b.pt").read_bytes()  # torch.save's serialization id
    assert a == b
    changed = {"model": {"w": torch.arange(6.0).reshape(2, 3), "b": torch.tensor(0.25)}, "step": 3}
    assert saved("c.pt", changed) != a
    (tmp_path / "d.json").write_text(json.dumps({"x": 1}))
    assert content_digest(tmp_path / "d.json", {"blake3": "ab"}) == "blake3:ab"


def test_the_docs_list_the_launch_contract_as_the_code_defines_it():
    from pathlib import Path

    from trainflow.program import CONTRACT

    doc = (Path(__file__).resolve().parents[2] / "docs" / "programs.md").read_text()
    rows = [line for line in doc.splitlines() if line.startswith("| `") and line.count("|") == 3]
    table = {
        line.split("`")[1]: line.split("|")[2].strip()
        for line in rows
        if line.split("`")[1] in CONTRACT or line.split("`")[1].isupper()
    }
    assert table == CONTRACT
