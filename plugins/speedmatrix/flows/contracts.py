"""The typed hand-offs between speed_matrix's steps after `resolved`: the server, what it
reports, the plan and the landing, each a TypedDict with its wire (XCom) form.

Why TypedDicts, as `flows.resolved.Resolved` is: each crosses XCom as the plain JSON object it
has always been (keys and values unchanged, so Airflow's serialisation and every reader of
the XCom stay as they are), and lets a type checker and a reader see every key in one place.
What a TypedDict cannot do is refuse a wrong object at run time: `from_wire` does that at the
XCom boundary (the DAG's tasks), with pydantic over the same TypedDict (strict: no coercion;
ranges and allowed values declared beside each key), naming the hand-off, the field and the
value, so a task fed another task's value, a value of an older shape or a wrong value fails
where it reads it and says why, not three calls later. `to_wire` checks the same on the way
out and returns a plain dict.

The steps themselves (flows/matrix.py, flows/server.py) take and return these types; only the
DAG's tasks and the demo's XCom reader hold the wire form.

| hand-off | made by | read by |
|---|---|---|
| ServerHandoff (`SERVER`) | `setup` | `inspect`, the cells, `teardown`, `validate` |
| ServerInfo (`INFO`) | `inspect` | `plan`, `validate` (the runs row) |
| Planned (`PLAN`) | `plan` | the cell lists (`plan.task_cells`), `validate` |
| Landing (`LANDING`) | `land` | `report`, `regressions`, `conclude`, the demo's summary |
| Resolved (`RESOLVED`, flows/resolved.py) | `resolve` | every later task |
| CellResult (`CELL_RESULT`) | `prefill`, `decode` (`run_cell`) | `validate` (`collect`) |
| TornDown (`TEARDOWN`) | `stop_server` (`teardown`) | the DAG run's record |
| Validated (`VALIDATED`) | `validate` | `land` |
"""

# No `from __future__ import annotations`: TypedDict reads NotRequired from evaluated
# annotations only (with string ones every key counts as required). typing_extensions'
# TypedDict: pydantic validates only that one on Python 3.11.
import json
from collections.abc import Mapping
from typing import Annotated, Any, Generic, Literal, NotRequired, TypeVar

from pydantic import ConfigDict, Field, TypeAdapter, ValidationError, with_config
from typing_extensions import TypedDict

from speedmatrix.flows.resolved import Resolved

T = TypeVar("T")

CHECKED = ConfigDict(extra="forbid", strict=True)
"""How every hand-off is checked: no key it does not declare, no value coerced ("3" is not 3)."""
Count = Annotated[int, Field(ge=0)]
Seconds = Annotated[float, Field(ge=0)]


@with_config(CHECKED)
class ServerHandoff(TypedDict):
    """The run's server: how to reach it, how to stop it, what was installed to run it."""

    handle: dict[str, Any]  # engine.vllm_server.ServerHandle.to_dict(): reach and stop it
    base_url: str  # as seen from the host itself
    python: str | None  # the engine env's python on the host (the probes, the zipapp)
    loadgen: str | None  # the load generator zipapp shipped to the host; None: in-process
    engine_version: str | None  # as provisioning found it
    engine_commit: str | None  # the full SHA when provisioning resolved it
    provision_s: Seconds
    start_s: Seconds
    # present (True) only for a server already running (`speedmatrix run --base-url`):
    # nothing was provisioned or started, so nothing of it is stopped
    existing: NotRequired[bool]


@with_config(CHECKED)
class ServerInfo(TypedDict):
    """What the server says about itself (`inspect`): the plan's capacity, the runs row's facts."""

    version: str | None  # its /version
    commit: str | None  # the commit the engine env records; None for a server not ours
    kv_num_blocks: Count
    kv_block_size: Count
    kv_cache_tokens: Count
    max_model_len: Count | None
    gpu: str | None
    gpu_count: Count | None
    launch_command: str  # secrets redacted
    hardware: dict[str, Any]  # engine.vllm_server.gpus: gpus, gpu_count, driver...
    sim_profile: str | None  # the simulator's profile; None for a real engine


@with_config(CHECKED)
class Planned(TypedDict):
    """The cells of the run (`plan.Plan.as_dict`): small dicts, each a mapped task's input."""

    prefill: list[dict[str, Any]]
    decode: list[dict[str, Any]]
    over_capacity: list[dict[str, Any]]  # records of cells not run (status over_capacity)
    # every cell to run in the host's order (plan.run_order); absent from a plan made before
    # it existed, which plan.task_cells maps phase by phase
    order: NotRequired[list[dict[str, Any]]]


@with_config(CHECKED)
class Landing(TypedDict):
    """What `land` landed: where, with what status, how much, and what failed."""

    run_id: Annotated[str, Field(min_length=1)]
    status: Literal["success", "partial", "failed"]  # the runs row's (records.RUN_STATUSES)
    warehouse: str  # the warehouse root the run landed in
    cells: Count
    requests: Count
    repeats: Count
    quarantined: list[Any]  # what validation sent to quarantine instead (quality.py)
    failed: list[str]  # "phase label x concurrency: why" of each failed cell
    failed_repeats: list[str]


@with_config(CHECKED)
class CellResult(TypedDict):
    """One cell task's result: its record (records.to_wire), its request rows, which pass."""

    cell: dict[str, Any]  # the CellRecord's wire form (records.to_wire)
    requests: list[dict[str, Any]]
    repeat: NotRequired[Count]  # 0: the primary pass; n: the n-th repeat
    turn: NotRequired[dict[str, Any] | None]  # when the cell held the host (flows.turn)


@with_config(CHECKED)
class TornDown(TypedDict):
    """What `teardown` did: the servers it stopped and what became of the lease."""

    # the first stop's outcome (engine.vllm_server.stop_server's record: pid, was_running,
    # gone, killed, left ...); None: no server of this run to stop
    stopped: dict[str, Any] | None
    all_stopped: list[dict[str, Any]]
    from_records: list[str]  # servers found in the host's records, not in the setup's handle
    lease: str | None  # released, kept ...


@with_config(CHECKED)
class Validated(TypedDict):
    """What `validate` hands `land`: the checked rows (records' wire forms) and what it
    quarantined (quality.check_for_landing)."""

    run: dict[str, Any]
    cells: list[dict[str, Any]]
    requests: list[dict[str, Any]]
    repeats: list[dict[str, Any]]
    quarantined: list[dict[str, Any]]
    gx_results: str


class HandoffError(ValueError):
    """A value read as a hand-off is not one: keys missing or unknown, or not an object."""


class Contract(Generic[T]):
    """One hand-off's wire form: `to_wire` on the way into XCom, `from_wire` on the way out."""

    def __init__(self, name: str, typed: type) -> None:
        self.name = name
        self.required = frozenset(typed.__required_keys__)  # type: ignore[attr-defined]
        self.keys = frozenset(typed.__annotations__)
        self.values = TypeAdapter(typed)

    def _checked(self, value: object) -> dict[str, Any]:
        if not isinstance(value, Mapping):
            raise HandoffError(f"{self.name}: expected an object, got {type(value).__name__}")
        missing = sorted(self.required - set(value))
        unknown = sorted(set(value) - self.keys)
        if missing or unknown:
            said = [f"missing {missing}"] * bool(missing) + [f"unknown {unknown}"] * bool(unknown)
            raise HandoffError(f"{self.name}: {'; '.join(said)}")
        try:
            return dict(self.values.validate_python(dict(value)))
        except ValidationError as exc:
            raise HandoffError(f"{self.name}: {_problems(exc)}") from None

    def to_wire(self, value: T) -> dict[str, Any]:
        """The plain JSON object XCom carries; HandoffError when `value` is not this hand-off
        or holds a value JSON cannot carry."""
        try:
            json.dumps(dict(value) if isinstance(value, Mapping) else value)
        except (TypeError, ValueError) as exc:
            raise HandoffError(f"{self.name}: not JSON: {exc}") from None
        return self._checked(value)

    def from_wire(self, raw: object) -> T:
        """The hand-off read back from XCom (or JSON); HandoffError when it is not one."""
        return self._checked(raw)  # type: ignore[return-value]  # its keys and values, checked

    def from_wire_or_none(self, raw: object) -> T | None:
        """As `from_wire`, None for None: the XCom of a task that failed or never ran."""
        return None if raw is None else self.from_wire(raw)


def _problems(exc: ValidationError) -> str:
    """pydantic's errors as one line: `field.sub[0]: what is wrong (got value)` each."""
    out = []
    errors = exc.errors()
    for err in errors[:5]:
        where = ""
        for part in err["loc"]:
            where += f"[{part}]" if isinstance(part, int) else ("." if where else "") + str(part)
        got = repr(err.get("input"))
        out.append(f"{where or '(top)'}: {err['msg']} (got {got[:80]})")
    more = f"; and {len(errors) - 5} more" if len(errors) > 5 else ""
    return "; ".join(out) + more


SERVER: Contract[ServerHandoff] = Contract("server hand-off (setup_server)", ServerHandoff)
INFO: Contract[ServerInfo] = Contract("server info (inspect)", ServerInfo)
PLAN: Contract[Planned] = Contract("plan (plan)", Planned)
LANDING: Contract[Landing] = Contract("landing (land)", Landing)
RESOLVED: Contract[Resolved] = Contract("run description (resolve)", Resolved)
CELL_RESULT: Contract[CellResult] = Contract("cell result (prefill/decode)", CellResult)
TEARDOWN: Contract[TornDown] = Contract("teardown (stop_server)", TornDown)
VALIDATED: Contract[Validated] = Contract("validated rows (validate)", Validated)
