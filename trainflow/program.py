"""The user's own training program: its argv, environment and launch contract.

A run with ``program`` set launches that program on every rank instead of trainflow's
built-in loop, through the same node agent (torch elastic, as ``torchrun`` would). Each
rank starts as ``python -m trainflow.launch.program``, which agrees on the gang's resume
point with the other ranks, sets the contract's variables (``CONTRACT``), resolves the
placeholders (``PLACEHOLDERS``) and ``exec``s the program in its place: the process torch
elastic watches is the program itself.

This module holds the pure parts: validation of the spec's fields (syntax, in the spec;
the program's existence and its allowed place, at provision) and placeholder
resolution. Standard library only.
"""

from __future__ import annotations

import importlib.util
import os
import re
import string
import sys
from pathlib import Path
from typing import Any, Mapping, Sequence

from trainflow.errors import SpecError

# Placeholders a program's argv may use, resolved for every gang start.
PLACEHOLDERS = {
    "checkpoint_dir": "the directory the program's checkpoints go in (TRAINFLOW_CHECKPOINT_DIR)",
    "resume_from": "the newest verified checkpoint, empty on a fresh start (TRAINFLOW_RESUME_FROM)",
    "run_id": "the run's id, the same for every retry (TRAINFLOW_RUN_ID)",
    "attempt": "how many gangs of this run started before this one (TRAINFLOW_ATTEMPT)",
}

# The launch contract: what every rank of a program finds in its environment.
CONTRACT = {
    "RANK": "global rank (torch elastic)",
    "LOCAL_RANK": "rank on this node (torch elastic)",
    "WORLD_SIZE": "ranks in the gang (torch elastic)",
    "LOCAL_WORLD_SIZE": "ranks on this node (torch elastic)",
    "GROUP_RANK": "this node's rank among the gang's nodes (torch elastic)",
    "ROLE_RANK": "rank among the workers of the same role (torch elastic)",
    "MASTER_ADDR": "address of the gang's store (torch elastic)",
    "MASTER_PORT": "port of the gang's store (torch elastic)",
    "TORCHELASTIC_RESTART_COUNT": "restarts by this node's agent (torch elastic)",
    "TORCHELASTIC_RUN_ID": "the rendezvous id (torch elastic)",
    "TRAINFLOW_RUN_ID": "the run's id, stable across every restart and retry",
    "TRAINFLOW_ATTEMPT": "gangs of this run started before this one (0 on the first start)",
    "TRAINFLOW_CHECKPOINT_DIR": "where checkpoints go (the SDK's checkpoint(step) gives a directory in it)",
    "TRAINFLOW_RESUME_FROM": "the newest verified checkpoint's directory; empty on a fresh start",
    "TRAINFLOW_RESUME_STEP": "its step; 0 on a fresh start",
    "TRAINFLOW_PROGRESS": "where the SDK reports progress (the run's heartbeat directory)",
    "TRAINFLOW_RUN_DIR": "the run's workspace",
}

# Names ``program_env`` may not set: the contract's, and what the chip families' visibility
# and trainflow's own launch rely on.
RESERVED_ENV = frozenset(CONTRACT) | {
    "GROUP_WORLD_SIZE",
    "ROLE_WORLD_SIZE",
    "ROLE_NAME",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_USE_AGENT_STORE",
    "TORCHELASTIC_ERROR_FILE",
    "CUDA_VISIBLE_DEVICES",
    "HIP_VISIBLE_DEVICES",
    "ASCEND_RT_VISIBLE_DEVICES",
    "MLU_VISIBLE_DEVICES",
    "XPU_VISIBLE_DEVICES",
    "MUSA_VISIBLE_DEVICES",
    "LD_PRELOAD",
    "LD_LIBRARY_PATH",
    "PYTHONPATH",
    "PYTHONHOME",
    "PATH",
    "HOME",
    "USER",
    "OMP_NUM_THREADS",
}
RESERVED_PREFIXES = ("TRAINFLOW_", "TORCHELASTIC_", "AIRFLOW_", "AIRFLOW__")
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
MODULE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
MAX_ARGS = 256
MAX_ARG_CHARS = 4096
MAX_ENV = 64
MAX_ENV_VALUE = 4096
PYTHON = "python"  # argv[0] meaning "the worker's own interpreter"

ROOTS_ENV = "TRAINFLOW_PROGRAM_ROOTS"
MODULES_ENV = "TRAINFLOW_PROGRAM_MODULES"
DEFAULT_MODULES = "trainflow.worker,programs"

ARGV_FIX = (
    'a list of strings, e.g. ["python", "-m", "myteam.train", "--out", "{checkpoint_dir}"] '
    "(an argv, never a shell string)"
)


def check_syntax(program: Any, program_env: Any, working_dir: str) -> tuple[tuple[str, ...], dict[str, str]]:
    """``program``, ``program_env`` and ``working_dir`` checked for what needs no
    filesystem: types, sizes, NUL bytes, placeholders, variable names. Returns the argv as
    a tuple and the environment as a plain dict.

    Raises:
        SpecError: naming the field, the value and the fix.
    """
    if isinstance(program, str):
        raise SpecError("program", program, ARGV_FIX)
    if not isinstance(program, (list, tuple)):
        raise SpecError("program", program, ARGV_FIX)
    argv = tuple(program)
    if len(argv) > MAX_ARGS:
        raise SpecError("program", f"<{len(argv)} arguments>", f"at most {MAX_ARGS} arguments")
    for i, arg in enumerate(argv):
        if not isinstance(arg, str):
            raise SpecError(f"program[{i}]", arg, "every argument is a string")
        if "\x00" in arg:
            raise SpecError(f"program[{i}]", arg, "must not contain NUL bytes")
        if len(arg) > MAX_ARG_CHARS:
            raise SpecError(f"program[{i}]", arg[:80] + "…", f"at most {MAX_ARG_CHARS} characters")
        for name in placeholders_in(arg, field=f"program[{i}]"):
            if name not in PLACEHOLDERS:
                raise SpecError(
                    f"program[{i}]",
                    arg,
                    f"unknown placeholder {{{name}}}; use "
                    f"{', '.join('{' + p + '}' for p in PLACEHOLDERS)} (or {{{{ }}}} for a brace)",
                )
    if argv and argv[0] == "":
        raise SpecError("program[0]", "", "the program to run: 'python' (with '-m module' or a script) or a path")
    if argv and argv[0] == PYTHON:
        if len(argv) < 2:
            raise SpecError("program", list(argv), "'python' needs '-m package.module' or a script path")
        if argv[1] == "-m" and (len(argv) < 3 or not MODULE.match(argv[2])):
            raise SpecError("program", list(argv), "'python -m' needs a module name, e.g. 'myteam.train'")
    if not isinstance(program_env, Mapping):
        raise SpecError("program_env", program_env, 'an object of variables, e.g. {"MY_SETTING": "1"}')
    if len(program_env) > MAX_ENV:
        raise SpecError("program_env", f"<{len(program_env)} variables>", f"at most {MAX_ENV} variables")
    env = {}
    for name, value in program_env.items():
        if not isinstance(name, str) or not ENV_NAME.match(name):
            raise SpecError(
                "program_env", name, "variable names are letters, digits and '_', not starting with a digit"
            )
        if name in RESERVED_ENV or name.startswith(RESERVED_PREFIXES):
            raise SpecError(
                f"program_env.{name}",
                value,
                f"{name} is set by trainflow's launch (the "
                f"contract, the chip's visibility or the worker's interpreter); remove it",
            )
        if not isinstance(value, str) or "\x00" in value or len(value) > MAX_ENV_VALUE:
            raise SpecError(
                f"program_env.{name}", value, f"a string without NUL bytes, at most {MAX_ENV_VALUE} characters"
            )
        env[name] = value
    if working_dir and not working_dir.startswith("/"):
        raise SpecError("working_dir", working_dir, "an absolute path, or empty for the run's workspace")
    if working_dir and ".." in Path(working_dir).parts:
        raise SpecError("working_dir", working_dir, "must not contain '..'")
    return argv, env


def placeholders_in(arg: str, *, field: str) -> list[str]:
    """The placeholder names ``arg`` uses (``{{``/``}}`` are literal braces)."""
    try:
        parsed = list(string.Formatter().parse(arg))
    except ValueError as exc:
        raise SpecError(field, arg, f"{exc}: write a literal brace as {{{{ or }}}}") from exc
    names = []
    for _, name, spec, conversion in parsed:
        if name is None:
            continue
        if spec or conversion or not name.isidentifier():
            raise SpecError(field, arg, "placeholders are plain names such as {checkpoint_dir}")
        names.append(name)
    return names


def resolve(argv: Sequence[str], values: Mapping[str, str]) -> list[str]:
    """``argv`` with its placeholders replaced by ``values`` (every name of
    ``PLACEHOLDERS``); the interpreter for ``python``."""
    out = [arg.format_map(values) for arg in argv]
    if out and out[0] == PYTHON:
        out[0] = sys.executable
    return out


def allowed_roots(env: Mapping[str, str] | None = None) -> tuple[Path, ...]:
    raw = (os.environ if env is None else env).get(ROOTS_ENV, "")
    return tuple(Path(p).resolve() for p in raw.split(os.pathsep) if p.strip())


def allowed_modules(env: Mapping[str, str] | None = None) -> tuple[str, ...]:
    raw = (os.environ if env is None else env).get(MODULES_ENV, DEFAULT_MODULES)
    return tuple(p.strip() for p in raw.split(",") if p.strip())


def check_place(argv: Sequence[str], working_dir: str = "", env: Mapping[str, str] | None = None) -> str:
    """The program exists where workers will run it and comes from an allowed place:
    ``python -m module`` with the module under ``TRAINFLOW_PROGRAM_MODULES`` (default
    ``trainflow.worker,programs``), or a script (``python path`` or an executable path)
    under a directory of ``TRAINFLOW_PROGRAM_ROOTS``. Returns what will run, in words.

    Raises:
        SpecError: naming the field, the value and the fix.
    """
    if argv[0] == PYTHON and argv[1] == "-m":
        module = argv[2]
        prefixes = allowed_modules(env)
        if not any(module == p or module.startswith(p + ".") for p in prefixes):
            raise SpecError(
                "program[2]",
                module,
                f"modules run from {', '.join(prefixes)} only; put the "
                f"program there or add its package to {MODULES_ENV}",
            )
        try:
            found = importlib.util.find_spec(module)
        except (ImportError, ValueError):
            found = None
        if found is None:
            raise SpecError(
                "program[2]",
                module,
                "no such module on the workers' Python path; install the package on the workers or fix the name",
            )
        return f"python -m {module}"
    script_field, script = ("program[1]", argv[1]) if argv[0] == PYTHON else ("program[0]", argv[0])
    path = Path(script)
    if not path.is_absolute():
        path = Path(working_dir or ".") / path
        if not working_dir:
            raise SpecError(script_field, script, "an absolute path (or set working_dir), e.g. /opt/team/train.py")
    real = path.resolve()
    roots = allowed_roots(env)
    if not any(real == root or root in real.parents for root in roots):
        raise SpecError(
            script_field,
            script,
            f"scripts run from {ROOTS_ENV} only "
            f"({os.pathsep.join(map(str, roots)) or 'none set'}); put it there or add its directory",
        )
    if not real.is_file():
        raise SpecError(script_field, script, "no such file on this host; install it on the workers")
    if argv[0] != PYTHON and not os.access(real, os.X_OK):
        raise SpecError(script_field, script, f"not executable; chmod +x it or run it as ['python', {script!r}, …]")
    return f"{'python ' if argv[0] == PYTHON else ''}{real}"
