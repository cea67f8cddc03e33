"""``TrainingSpec``: the one typed description of a training run.

The spec is validated in one place (``__post_init__``). The Airflow trigger form and the
REST ``conf`` are validated by the same rules because the DAG's ``Param``s are generated
from ``param_schema()``; the node agent and the workers parse the same spec back with
``TrainingSpec.from_json``.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Mapping, Sequence

from trainflow.chips.registry import FAMILIES
from trainflow.errors import SpecError
from trainflow.faults import FAULT_SCHEMA, FaultKind, parse_faults

BUILTIN_WORKLOADS = ("digits", "tinylm")
STRATEGIES = ("ddp", "fsdp")
PRECISIONS = ("fp32", "bf16", "fp16", "auto")
LAUNCHERS = ("local", "kubernetes")
IMAGE_PATTERN = r"^([a-z0-9]+([._/:@-][A-Za-z0-9_]+)*)?$"
BATCH_POLICIES = ("keep_global", "keep_per_rank")
MAX_NODES = 64
# A count (1-64) or 'min:max'; refuses 0 and leading zeros (the trigger form checks it too).
NODES_PATTERN = r"^[1-9][0-9]?(:[1-9][0-9]?)?$"
NAME_PATTERN = r"^[a-z0-9][a-z0-9-]{0,62}$"
# Built-in names, or 'package.module:function' (so the trigger form refuses anything else).
WORKLOAD_PATTERN = (
    r"^(" + "|".join(BUILTIN_WORKLOADS) + r"|[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*)$"
)
STORE_PATTERN = r"^(|file:///[A-Za-z0-9_./-]*|s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](/[A-Za-z0-9_./-]*)?)$"

# Fields whose values change the trained weights; the checkpoint manifest records their
# hash so a run never resumes from another run's state. World size is checked separately.
_TRAINING_FIELDS = ("workload", "chip", "strategy", "steps", "batch_size", "lr", "seed")
# ... and, only where they are not the default, the batch policy and the precision (older
# manifests stay valid).


def _meta(title: str, description: str, **schema: Any) -> dict[str, Any]:
    return {"title": title, "description": description, "schema": schema}


# The trigger form's groups (Airflow ``Param(section=...)``); a field named in none stays at
# the top of the form.
SECTIONS: dict[str, tuple[str, ...]] = {
    "Gang": ("nodes", "nproc_per_node", "spares", "shrink_grace", "batch_policy"),
    "Chip": ("chip", "chip_model", "launcher", "image"),
    "Optimisation": ("steps", "batch_size", "lr", "seed", "precision", "strategy", "record_samples"),
    "Checkpoints": ("checkpoint_interval", "checkpoint_mode", "keep_last", "store_uri"),
    "Health": (
        "heartbeat_interval",
        "heartbeat_timeout",
        "startup_timeout",
        "checkpoint_timeout",
        "stall_timeout",
        "straggler_margin",
        "exclude_stragglers",
        "crash_loop_limit",
        "retries",
        "memory_limit_mb",
        "open_files_limit",
    ),
    "Scheduling": ("tenant", "priority", "runtime_estimate", "preemptible", "admission_timeout"),
    "Program": ("program", "program_env", "working_dir", "exit_codes_no_retry"),
    "Rehearsal faults": ("faults",),
}
# String fields whose empty value means "not set": optional in the form (null or absent).
OPTIONAL_STRINGS = ("chip_model", "image", "store_uri", "working_dir")


@dataclass(frozen=True, kw_only=True)
class TrainingSpec:
    """A training run. Every field is validated in ``__post_init__``."""

    workload: str = field(
        default="digits",
        metadata=_meta(
            "Workload",
            "Built-in workload (digits, tinylm) or the import path of your own, "
            "'package.module:build', returning model, datasets, loss and evaluation.",
            pattern=WORKLOAD_PATTERN,
            maxLength=200,
        ),
    )
    nodes: int | str = field(
        default=2,
        metadata=_meta(
            "Nodes",
            "Nodes of the gang (one shard_train task each): a number (fixed size, "
            "admitted all-or-nothing) or 'min:max' (elastic: starts with at least min, grows up "
            "to max as capacity frees, shrinks down to min when a node is lost for good).",
            minimum=1,
            maximum=MAX_NODES,
            pattern=NODES_PATTERN,
        ),
    )
    spares: int = field(
        default=0,
        metadata=_meta(
            "Hot spares",
            "Extra nodes admitted, preflight-checked and waiting in the rendezvous; "
            "a failed node is replaced by one at once, with no Airflow retry.",
            minimum=0,
            maximum=8,
        ),
    )
    shrink_grace: float = field(
        default=30.0,
        metadata=_meta(
            "Shrink grace (s)",
            "Elastic runs: how long the gang waits for a lost node's replacement "
            "before it goes on with fewer nodes (never fewer than min).",
            minimum=1,
            maximum=3600,
        ),
    )
    batch_policy: str = field(
        default="keep_global",
        metadata=_meta(
            "Batch policy",
            "Elastic runs, when the world size changes: keep_global keeps the global "
            "batch (batch_size × the full world size) and splits it over the ranks there are, so every "
            "step trains on the same samples as at full size; keep_per_rank keeps batch_size per rank "
            "and the global batch follows the world size.",
            enum=list(BATCH_POLICIES),
        ),
    )
    record_samples: bool = field(
        default=False,
        metadata=_meta(
            "Record samples",
            "Write the sample indices every rank trains on at every step to "
            "samples/rank-<r>.jsonl in the run's workspace (data lineage: coverage can be audited).",
        ),
    )
    nproc_per_node: int = field(
        default=1,
        metadata=_meta(
            "Processes per node", "Worker processes (ranks) per node, usually one per chip.", minimum=1, maximum=16
        ),
    )
    chip: str = field(
        default="cpu",
        metadata=_meta(
            "Chip family", "Accelerator family; decides the queue, device and backend.", enum=sorted(FAMILIES)
        ),
    )
    chip_model: str = field(
        default="",
        metadata=_meta(
            "Chip model",
            "Model within the family (h100, 910b ...): the node tasks go to queue "
            "<chip>-<model>. Empty: the family's default queue.",
            pattern=r"^([a-z0-9][a-z0-9-]{0,30})?$",
        ),
    )
    precision: str = field(
        default="fp32",
        metadata=_meta(
            "Precision",
            "fp32; bf16 or fp16 autocast (fp16 with loss scaling); auto: bf16 where the "
            "chip's bf16 rule allows it, else fp16.",
            enum=list(PRECISIONS),
        ),
    )
    launcher: str = field(
        default="local",
        metadata=_meta(
            "Launcher",
            "local: each node task runs its node agent where Airflow placed it; kubernetes: "
            "each node runs as a pod (cncf-kubernetes provider) with the chip's device-plugin resources.",
            enum=list(LAUNCHERS),
        ),
    )
    image: str = field(
        default="",
        metadata=_meta(
            "Image",
            "Kubernetes launcher: the worker image (empty: the chip family's image).",
            pattern=IMAGE_PATTERN,
            maxLength=300,
        ),
    )
    strategy: str = field(
        default="ddp",
        metadata=_meta("Strategy", "ddp (replicated weights) or fsdp (FSDP2 fully_shard).", enum=list(STRATEGIES)),
    )
    steps: int = field(default=300, metadata=_meta("Steps", "Optimizer steps to train.", minimum=1, maximum=10_000_000))
    batch_size: int = field(
        default=32,
        metadata=_meta(
            "Batch size per rank",
            "Samples per rank per step; global batch = this × world size.",
            minimum=1,
            maximum=65_536,
        ),
    )
    lr: float = field(
        default=0.003,
        metadata=_meta(
            "Learning rate", "Peak AdamW learning rate (linear warm-up, cosine decay).", exclusiveMinimum=0, maximum=10
        ),
    )
    seed: int = field(
        default=0,
        metadata=_meta(
            "Seed",
            "Seed of weights, data order and every rank's RNG; same seed and world size give bit-identical weights.",
            minimum=0,
            maximum=2**31 - 1,
        ),
    )
    checkpoint_interval: int = field(
        default=50,
        metadata=_meta(
            "Checkpoint interval",
            "Save a sharded checkpoint every this many steps (≤ steps).",
            minimum=1,
            maximum=10_000_000,
        ),
    )
    checkpoint_mode: str = field(
        default="async",
        metadata=_meta(
            "Checkpoint mode",
            "async: training stalls only for the in-memory copy while a "
            "background thread writes; sync: training waits for the write.",
            enum=["async", "sync"],
        ),
    )
    keep_last: int = field(
        default=3,
        metadata=_meta("Keep last K", "Verified checkpoints kept; older ones are pruned.", minimum=1, maximum=100),
    )
    heartbeat_interval: float = field(
        default=1.0,
        metadata=_meta(
            "Heartbeat interval (s)", "How often each rank reports its training progress.", minimum=0.1, maximum=60
        ),
    )
    heartbeat_timeout: float = field(
        default=60.0,
        metadata=_meta(
            "Heartbeat timeout (s)", "A rank silent this long while training is a hang.", minimum=1, maximum=3600
        ),
    )
    startup_timeout: float = field(
        default=300.0,
        metadata=_meta(
            "Startup timeout (s)", "Longest wait for the first heartbeat of every rank.", minimum=5, maximum=7200
        ),
    )
    checkpoint_timeout: float = field(
        default=600.0,
        metadata=_meta(
            "Checkpoint timeout (s)",
            "Longest a rank may go without a step while it saves a checkpoint or evaluates (a "
            "program's sdk.phase('checkpoint') or ('eval') section); the heartbeat timeout applies "
            "to steps, the startup timeout to start-up.",
            minimum=1,
            maximum=86400,
        ),
    )
    stall_timeout: float = field(
        default=600.0,
        metadata=_meta(
            "Stall timeout (s)",
            "A program that reports nothing through the SDK is a hang when neither its output "
            "nor its checkpoints advanced for this long (its ranks' progress is what they print "
            "and save); SDK programs and the built-in loop use the heartbeat timeout.",
            minimum=1,
            maximum=86400,
        ),
    )
    straggler_margin: float = field(
        default=0.5,
        metadata=_meta(
            "Straggler margin",
            "A rank whose compute time per step exceeds the median of its "
            "peers by more than this fraction is reported as a straggler.",
            minimum=0.05,
            maximum=100,
        ),
    )
    exclude_stragglers: bool = field(
        default=False,
        metadata=_meta(
            "Exclude stragglers",
            "Replace a node whose rank is a confirmed straggler, right after "
            "the next checkpoint commits (no work lost), and cordon its host until it passes its "
            "health check.",
        ),
    )
    crash_loop_limit: int = field(
        default=3,
        metadata=_meta(
            "Crash-loop limit",
            "Restarts from the same checkpoint after which the run stops with a clear error instead of retrying.",
            minimum=1,
            maximum=100,
        ),
    )
    retries: int = field(
        default=2,
        metadata=_meta(
            "Retries", "Airflow retries of a node task after an infrastructure failure.", minimum=0, maximum=10
        ),
    )
    memory_limit_mb: int = field(
        default=0,
        metadata=_meta(
            "Memory limit per worker (MiB)",
            "Data memory each worker process may allocate "
            "(RLIMIT_DATA); past it an allocation fails with MemoryError and the run stops as a "
            "user error instead of the host running out. 0: no limit.",
            minimum=0,
            maximum=16 * 1024 * 1024,
        ),
    )
    open_files_limit: int = field(
        default=0,
        metadata=_meta(
            "Open files per worker",
            "Files and sockets each worker process may hold open "
            "(RLIMIT_NOFILE, at most the host's hard limit). 0: inherited.",
            minimum=0,
            maximum=1 << 20,
        ),
    )
    priority: int = field(
        default=0,
        metadata=_meta(
            "Priority",
            "Admission order in the node pool: higher first, first come first served within a priority.",
            minimum=-100,
            maximum=100,
        ),
    )
    runtime_estimate: float = field(
        default=0.0,
        metadata=_meta(
            "Runtime estimate (s)",
            "Expected seconds from admission to the end of the run. A pool "
            "set to backfill may start the run early, in nodes the first waiting gang's reservation "
            "leaves free meanwhile. 0: estimated from the DAG's completed runs of the same workload "
            "and node count, if any.",
            minimum=0,
            maximum=365 * 86_400,
        ),
    )
    preemptible: bool = field(
        default=False,
        metadata=_meta(
            "Preemptible",
            "A waiting run of higher priority (or, in a pool with quotas, within its "
            "tenant's quota while this run borrows) may stop this one: it checkpoints at the next "
            "step boundary, gives its nodes back, waits in the queue and resumes from that "
            "checkpoint. Fixed-size gangs without spares on the local launcher.",
        ),
    )
    admission_timeout: float = field(
        default=86_400.0,
        metadata=_meta(
            "Admission timeout (s)",
            "Longest wait in the pool's queue for the gang's nodes before "
            "provision fails (the wait is deferred: it holds no worker slot).",
            minimum=1,
            maximum=30 * 86_400,
        ),
    )
    store_uri: str = field(
        default="",
        metadata=_meta(
            "Checkpoint store",
            "Durable checkpoint store: empty for the run's workspace, "
            "file:///absolute/dir, or s3://bucket/prefix (credentials from the Airflow connection "
            "trainflow_s3 or the standard AWS chain, never here).",
            pattern=STORE_PATTERN,
            maxLength=500,
        ),
    )
    tenant: str = field(
        default="default",
        metadata=_meta(
            "Tenant", "Owner of the run; lower-case letters, digits and '-'.", pattern=NAME_PATTERN, maxLength=63
        ),
    )
    program: tuple = field(
        default=(),
        metadata=_meta(
            "Program",
            "Your own training program, run on every rank instead of the built-in loop "
            '(the workload): an argv list such as ["python", "-m", "myteam.train", "--out", '
            '"{checkpoint_dir}", "--resume", "{resume_from}"]; placeholders {checkpoint_dir}, '
            "{resume_from}, {run_id}, {attempt}. Empty for the built-in loop.",
            items={"type": "string", "maxLength": 4096},
            maxItems=256,
        ),
    )
    program_env: dict = field(
        default_factory=dict,
        metadata=_meta(
            "Program environment",
            "Extra environment variables for the program's ranks (names the "
            "launch sets, such as RANK or MASTER_ADDR, are refused).",
            maxProperties=64,
        ),
    )
    exit_codes_no_retry: tuple = field(
        default=(),
        metadata=_meta(
            "Exit codes that end the run",
            "Exit codes of the program that mean a user error: the run "
            "fails at once instead of restarting (for example [2] for a bad command line).",
            items={"type": "integer", "minimum": 1, "maximum": 255},
            maxItems=32,
        ),
    )
    working_dir: str = field(
        default="",
        metadata=_meta(
            "Working directory",
            "Absolute directory the program runs in; empty for the run's workspace.",
            maxLength=1000,
        ),
    )
    faults: tuple = field(
        default=(),
        metadata=_meta(
            "Fault schedule",
            "Faults to inject, to rehearse recovery (refused unless the DAG allows "
            "it or the deployment sets TRAINFLOW_ALLOW_FAULTS=1): a list of {kind, step, rank[, seconds]}. "
            "Kinds: kill_rank, kill_node, lose_node (its capacity leaves the pool for `seconds`, 0: until "
            "the run releases its nodes), stop_rank, corrupt_checkpoint, crash_rank, slow_rank, fill_disk, "
            "delay_heartbeats (for `seconds`), allocate (needs memory_limit_mb), raise. Empty for a normal run.",
            **FAULT_SCHEMA,
        ),
    )

    def __post_init__(self) -> None:
        object.__setattr__(self, "nodes", _parse_nodes(self.nodes))
        if isinstance(self.chip, (list, tuple)) or (isinstance(self.chip, str) and "," in self.chip):
            raise SpecError(
                "chip",
                self.chip,
                "a gang is one chip family: its collectives run on one "
                "backend (nccl, hccl, cncl ...) that cannot span families; run one gang "
                "per family, each its own run",
            )
        for f in fields(self):
            if f.type not in ("tuple", "int | str", "dict"):
                _check_field(f.name, getattr(self, f.name), f.type, f.metadata["schema"])
        from trainflow.program import check_syntax

        argv, env = check_syntax(self.program, self.program_env, self.working_dir)
        object.__setattr__(self, "program", argv)
        object.__setattr__(self, "program_env", env)
        codes = self.exit_codes_no_retry
        if (
            isinstance(codes, (str, bytes))
            or not isinstance(codes, (list, tuple))
            or len(codes) > 32
            or any(isinstance(c, bool) or not isinstance(c, int) or not 1 <= c <= 255 for c in codes)
        ):
            raise SpecError("exit_codes_no_retry", codes, "a list of at most 32 exit codes, each 1-255")
        object.__setattr__(self, "exit_codes_no_retry", tuple(codes))
        object.__setattr__(self, "faults", parse_faults(self.faults, world_size=self.world_size, steps=self.steps))
        for i, fault in enumerate(self.faults):
            if fault.kind == FaultKind.CORRUPT_CHECKPOINT and (
                fault.rank != 0 or (fault.step % self.checkpoint_interval and fault.step != self.steps)
            ):
                raise SpecError(
                    f"faults[{i}]",
                    fault.to_dict(),
                    f"corrupt_checkpoint needs rank 0 and a checkpoint step (a multiple of {self.checkpoint_interval})",
                )
        for i, fault in enumerate(self.faults):
            if fault.kind == FaultKind.ALLOCATE and not self.memory_limit_mb:
                raise SpecError(
                    f"faults[{i}]",
                    fault.to_dict(),
                    "allocate needs memory_limit_mb > 0 (it "
                    "allocates until the worker's limit; without one it would exhaust the host)",
                )
        if 0 < self.memory_limit_mb < 512:
            raise SpecError(
                "memory_limit_mb",
                self.memory_limit_mb,
                "at least 512 (a worker with PyTorch loaded "
                "needs a few hundred MiB before it trains), or 0 for no limit",
            )
        if 0 < self.open_files_limit < 64:
            raise SpecError("open_files_limit", self.open_files_limit, "at least 64, or 0 to inherit the host's")
        if self.checkpoint_interval > self.steps:
            raise SpecError(
                "checkpoint_interval",
                self.checkpoint_interval,
                f"must be at most steps ({self.steps}); lower it or raise steps",
            )
        if self.heartbeat_timeout < 2 * self.heartbeat_interval:
            raise SpecError(
                "heartbeat_timeout",
                self.heartbeat_timeout,
                f"must be at least 2 × heartbeat_interval ({self.heartbeat_interval})",
            )
        if self.elastic and self.heartbeat_timeout < self.shrink_grace + 10:
            raise SpecError(
                "heartbeat_timeout",
                self.heartbeat_timeout,
                f"must be at least shrink_grace + 10 s ({self.shrink_grace + 10:g}) in an "
                f"elastic gang, whose survivors wait shrink_grace for a replacement "
                f"without training; raise it or lower shrink_grace",
            )
        if self.preemptible and (self.elastic or self.spares or self.launcher != "local"):
            field_, value = (
                ("nodes", self.nodes)
                if self.elastic
                else ("spares", self.spares)
                if self.spares
                else ("launcher", self.launcher)
            )
            raise SpecError(
                field_,
                value,
                "a preemptible run is a fixed-size gang without spares on the "
                "local launcher (its requeue re-admits the same nodes); set preemptible=false "
                "or use a fixed nodes count, spares=0 and launcher=local",
            )
        if ".." in self.store_uri:
            raise SpecError("store_uri", self.store_uri, "must not contain '..'")

    # -- construction -----------------------------------------------------------------
    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> "TrainingSpec":
        """Build a spec from a mapping (REST conf, DAG params); unknown keys are refused."""
        if not isinstance(data, Mapping):
            raise SpecError("conf", data, "must be a JSON object of spec fields")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            name = unknown[0] if str(unknown[0]).isidentifier() else repr(unknown[0])
            raise SpecError(name, data[unknown[0]], f"unknown field; known fields: {', '.join(sorted(known))}")
        values = dict(data)
        for name in OPTIONAL_STRINGS:  # the trigger form sends null for an empty optional field
            if name in values and values[name] is None:
                values[name] = ""
        for f in fields(cls):  # JSON has one number type: accept 3.0 for 3, 3 for 3.0
            v = values.get(f.name)
            if f.type == "float" and isinstance(v, int) and not isinstance(v, bool):
                values[f.name] = float(v)
            elif f.type == "int" and isinstance(v, float) and v.is_integer():
                values[f.name] = int(v)
        return cls(**values)

    @classmethod
    def from_json(cls, text: str) -> "TrainingSpec":
        return cls.from_mapping(json.loads(text))

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["faults"] = [f.to_dict() for f in self.faults]
        d["program"] = list(self.program)
        d["exit_codes_no_retry"] = list(self.exit_codes_no_retry)
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    # -- derived ------------------------------------------------------------------------
    @property
    def min_nodes(self) -> int:
        return int(str(self.nodes).split(":")[0])

    @property
    def max_nodes(self) -> int:
        return int(str(self.nodes).split(":")[-1])

    @property
    def queue(self) -> str:
        """The Airflow queue the node tasks run on (``<chip>-<model>``, or ``cpu``)."""
        from trainflow.chips.registry import queue_for

        return queue_for(self.chip, self.chip_model or None)

    @property
    def elastic(self) -> bool:
        """The gang may change size (``nodes`` is 'min:max' with min < max)."""
        return self.min_nodes < self.max_nodes

    @property
    def world_size(self) -> int:
        """Ranks of the full gang (``max_nodes`` nodes)."""
        return self.max_nodes * self.nproc_per_node

    @property
    def min_world_size(self) -> int:
        return self.min_nodes * self.nproc_per_node

    @property
    def global_batch_size(self) -> int:
        """Samples per step of the full gang (what ``keep_global`` keeps at every size)."""
        return self.batch_size * self.world_size

    def global_batch_at(self, world: int) -> int:
        """Samples per step when ``world`` ranks train (the batch policy)."""
        return self.global_batch_size if self.batch_policy == "keep_global" else self.batch_size * world

    def training_hash(self) -> str:
        """Hash of the fields that decide the trained weights (checkpoint compatibility)."""
        values = {k: getattr(self, k) for k in _TRAINING_FIELDS}
        if self.batch_policy != "keep_global":
            values["batch_policy"] = self.batch_policy
        if self.precision != "fp32":
            values["precision"] = self.precision
        if self.program:  # a program's weights are its own business: its argv and environment
            values.update(program=list(self.program), program_env=self.program_env, working_dir=self.working_dir)
        payload = json.dumps(values, sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()[:16]


_JSON_TYPES = {
    "int": "integer",
    "float": "number",
    "str": "string",
    "tuple": "array",
    "bool": "boolean",
    "dict": "object",
    "int | str": ["integer", "string"],
}


def _parse_nodes(value: Any) -> int | str:
    """``nodes`` normalised: an int for a fixed size ("3", "3:3" → 3), "min:max" otherwise.

    Raises:
        SpecError: not a positive number or 'min:max' with 1 ≤ min ≤ max ≤ MAX_NODES.
    """
    fix = f"use a number of nodes (1..{MAX_NODES}) or 'min:max', e.g. '2:4'"
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise SpecError("nodes", value, fix)
    if isinstance(value, str):
        if not re.fullmatch(NODES_PATTERN, value):
            raise SpecError("nodes", value, fix)
        low, _, high = value.partition(":")
        low, high = int(low), int(high or low)
    else:
        low = high = value
    if not 1 <= low <= high <= MAX_NODES:
        raise SpecError("nodes", value, fix + (" with min ≤ max" if low > high else ""))
    return low if low == high else f"{low}:{high}"


def _check_field(name: str, value: Any, typ: str, schema: Mapping[str, Any]) -> None:
    if typ == "bool":
        if not isinstance(value, bool):
            raise SpecError(name, value, "must be true or false")
        return
    if typ == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            raise SpecError(name, value, "must be an integer")
    elif typ == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise SpecError(name, value, "must be a finite number")
    elif typ == "str":
        if not isinstance(value, str):
            raise SpecError(name, value, "must be a string")
        if "\x00" in value:
            raise SpecError(name, value, "must not contain NUL bytes")
    if "minimum" in schema and value < schema["minimum"]:
        raise SpecError(name, value, f"must be ≥ {schema['minimum']}")
    if "exclusiveMinimum" in schema and value <= schema["exclusiveMinimum"]:
        raise SpecError(name, value, f"must be > {schema['exclusiveMinimum']}")
    if "maximum" in schema and value > schema["maximum"]:
        raise SpecError(name, value, f"must be ≤ {schema['maximum']}")
    if "enum" in schema and value not in schema["enum"]:
        raise SpecError(name, value, f"must be one of {', '.join(map(str, schema['enum']))}")
    if "maxLength" in schema and len(value) > schema["maxLength"]:
        raise SpecError(name, value, f"must be at most {schema['maxLength']} characters")
    if "pattern" in schema and not re.fullmatch(schema["pattern"], value):
        if name == "workload":
            raise SpecError(name, value, f"use one of {', '.join(BUILTIN_WORKLOADS)} or 'package.module:build'")
        raise SpecError(name, value, f"must match {schema['pattern']}")


def check_tenants(tenants: Sequence[str] | None) -> tuple[str, ...] | None:
    """A DAG's tenants (``training_dag(tenants=...)``), checked: names as the spec's
    ``tenant`` field accepts them, at least one. None: any tenant may run the DAG."""
    if tenants is None:
        return None
    if isinstance(tenants, str) or not tenants:
        raise SpecError("tenants", tenants, "a non-empty list of tenant names, or None for any tenant")
    for name in tenants:
        TrainingSpec(tenant=name)  # the field's own pattern and its error
    return tuple(tenants)


def check_tenant(tenant: str, tenants: Sequence[str] | None) -> None:
    """Refuse a run whose ``tenant`` is not one of the DAG's (a user who may trigger this
    DAG cannot act, be billed or be shown as another tenant)."""
    if tenants is not None and tenant not in tenants:
        raise SpecError(
            "tenant",
            tenant,
            f"this DAG runs only for tenant(s) {', '.join(tenants)}; use one of them, or a DAG of your own tenant",
        )


def param_schema(
    defaults: Mapping[str, Any] | None = None, tenants: Sequence[str] | None = None
) -> dict[str, dict[str, Any]]:
    """JSON-schema keyword arguments for one Airflow ``Param`` per spec field.

    Args:
        defaults: per-DAG defaults overriding the dataclass defaults (validated).
        tenants: the DAG's tenants: the ``tenant`` field becomes a choice among them (the
            trigger form and Airflow's conf validation refuse any other).

    Returns:
        ``{field: {"default": ..., "type": ..., "title": ..., "description": ..., ...}}``.
    """
    base = TrainingSpec.from_mapping(dict(defaults or {}))
    section_of = {name: section for section, names in SECTIONS.items() for name in names}
    out: dict[str, dict[str, Any]] = {}
    for f in fields(TrainingSpec):
        meta = f.metadata
        default = getattr(base, f.name)
        out[f.name] = {
            "default": (
                [x.to_dict() for x in default]
                if f.name == "faults"
                else list(default)
                if f.type == "tuple"
                else dict(default)
                if f.type == "dict"
                else default
            ),
            "type": _JSON_TYPES[f.type],
            "title": meta["title"],
            "description": meta["description"],
            **meta["schema"],
        }
        if f.name in section_of:
            out[f.name]["section"] = section_of[f.name]
        if f.name in OPTIONAL_STRINGS and default == "":
            # Airflow's form takes an empty string default for a missing required value
            # (Trigger stays disabled): optional strings are nullable, unset by default.
            out[f.name].update(type=["null", "string"], default=None)
    # One line in the form, not a JSON box (a multi-type field without examples is shown as
    # one): the form types a string ("2", "2:4"); REST may send a number.
    out["nodes"].update(
        type=["string", "integer"], examples=["1", "2", "4", "2:4"], default=str(out["nodes"]["default"])
    )
    if (tenants := check_tenants(tenants)) is not None:
        out["tenant"]["enum"] = list(tenants)
        if out["tenant"]["default"] not in tenants:
            out["tenant"]["default"] = tenants[0]
    return out
