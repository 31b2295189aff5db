"""The typed hand-offs between speed_matrix's steps after `resolved`: the server, what it
reports, the plan and the landing, each a TypedDict with its wire (XCom) form.

Why TypedDicts, as `flows.resolved.Resolved` is: each crosses XCom as the plain JSON object it
has always been (keys and values unchanged, so Airflow's serialisation and every reader of
the XCom stay as they are), costs nothing at run time, and lets a type checker and a reader
see every key in one place. What a TypedDict cannot do is refuse a wrong object at run time:
`from_wire` does that at the XCom boundary (the DAG's tasks), naming the hand-off and the keys
missing or unknown, so a task fed another task's value, or a value of an older shape, fails
where it reads it and says why, not three calls later on a KeyError. `to_wire` checks the
same on the way out and returns a plain dict.

The steps themselves (flows/matrix.py, flows/server.py) take and return these types; only the
DAG's tasks and the demo's XCom reader hold the wire form.

| hand-off | made by | read by |
|---|---|---|
| ServerHandoff (`SERVER`) | `setup` | `inspect`, the cells, `teardown`, `validate` |
| ServerInfo (`INFO`) | `inspect` | `plan`, `validate` (the runs row) |
| Planned (`PLAN`) | `plan` | the cell lists (`plan.task_cells`), `validate` |
| Landing (`LANDING`) | `land` | `report`, `regressions`, `conclude`, the demo's summary |
"""

# No `from __future__ import annotations`: TypedDict reads NotRequired from evaluated
# annotations only (with string ones every key counts as required).
import json
from collections.abc import Mapping
from typing import Any, Generic, NotRequired, TypedDict, TypeVar

T = TypeVar("T")


class ServerHandoff(TypedDict):
    """The run's server: how to reach it, how to stop it, what was installed to run it."""

    handle: dict[str, Any]  # engine.vllm_server.ServerHandle.to_dict(): reach and stop it
    base_url: str  # as seen from the host itself
    python: str | None  # the engine env's python on the host (the probes, the zipapp)
    loadgen: str | None  # the load generator zipapp shipped to the host; None: in-process
    engine_version: str | None  # as provisioning found it
    engine_commit: str | None  # the full SHA when provisioning resolved it
    provision_s: float
    start_s: float
    # present (True) only for a server already running (`speedmatrix run --base-url`):
    # nothing was provisioned or started, so nothing of it is stopped
    existing: NotRequired[bool]


class ServerInfo(TypedDict):
    """What the server says about itself (`inspect`): the plan's capacity, the runs row's facts."""

    version: str | None  # its /version
    commit: str | None  # the commit the engine env records; None for a server not ours
    kv_num_blocks: int
    kv_block_size: int
    kv_cache_tokens: int
    max_model_len: int | None
    gpu: str | None
    gpu_count: int | None
    launch_command: str  # secrets redacted
    hardware: dict[str, Any]  # engine.vllm_server.gpus: gpus, gpu_count, driver...
    sim_profile: str | None  # the simulator's profile; None for a real engine


class Planned(TypedDict):
    """The cells of the run (`plan.Plan.as_dict`): small dicts, each a mapped task's input."""

    prefill: list[dict[str, Any]]
    decode: list[dict[str, Any]]
    over_capacity: list[dict[str, Any]]  # records of cells not run (status over_capacity)
    # every cell to run in the host's order (plan.run_order); absent from a plan made before
    # it existed, which plan.task_cells maps phase by phase
    order: NotRequired[list[dict[str, Any]]]


class Landing(TypedDict):
    """What `land` landed: where, with what status, how much, and what failed."""

    run_id: str
    status: str  # the runs row's: success, partial, failed (records.RUN_STATUSES)
    warehouse: str  # the warehouse root the run landed in
    cells: int
    requests: int
    repeats: int
    quarantined: list[Any]  # what validation sent to quarantine instead (quality.py)
    failed: list[str]  # "phase label x concurrency: why" of each failed cell
    failed_repeats: list[str]


class HandoffError(ValueError):
    """A value read as a hand-off is not one: keys missing or unknown, or not an object."""


class Contract(Generic[T]):
    """One hand-off's wire form: `to_wire` on the way into XCom, `from_wire` on the way out."""

    def __init__(self, name: str, typed: type) -> None:
        self.name = name
        self.required = frozenset(typed.__required_keys__)  # type: ignore[attr-defined]
        self.keys = frozenset(typed.__annotations__)

    def _checked(self, value: object) -> dict[str, Any]:
        if not isinstance(value, Mapping):
            raise HandoffError(f"{self.name}: expected an object, got {type(value).__name__}")
        missing = sorted(self.required - set(value))
        unknown = sorted(set(value) - self.keys)
        if missing or unknown:
            said = [f"missing {missing}"] * bool(missing) + [f"unknown {unknown}"] * bool(unknown)
            raise HandoffError(f"{self.name}: {'; '.join(said)}")
        return dict(value)

    def to_wire(self, value: T) -> dict[str, Any]:
        """The plain JSON object XCom carries; HandoffError when `value` is not this hand-off
        or holds a value JSON cannot carry."""
        out = self._checked(value)
        try:
            json.dumps(out)
        except (TypeError, ValueError) as exc:
            raise HandoffError(f"{self.name}: not JSON: {exc}") from None
        return out

    def from_wire(self, raw: object) -> T:
        """The hand-off read back from XCom (or JSON); HandoffError when it is not one."""
        return self._checked(raw)  # type: ignore[return-value]  # its keys, checked

    def from_wire_or_none(self, raw: object) -> T | None:
        """As `from_wire`, None for None: the XCom of a task that failed or never ran."""
        return None if raw is None else self.from_wire(raw)


SERVER: Contract[ServerHandoff] = Contract("server hand-off (setup_server)", ServerHandoff)
INFO: Contract[ServerInfo] = Contract("server info (inspect)", ServerInfo)
PLAN: Contract[Planned] = Contract("plan (plan)", Planned)
LANDING: Contract[Landing] = Contract("landing (land)", Landing)
