"""Response and request bodies of the HTTP API (they are the OpenAPI schema operators and clients see)."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Generic, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field

from switchyard.shared.placement_terms import DEFAULT_TIME_LIMIT_S

T = TypeVar("T")
GroupId = Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$", description="An engine group (EP group) id.")]


class _Out(BaseModel):
    model_config = ConfigDict(from_attributes=True)


class Page(_Out, Generic[T]):
    """One page of a listing, newest first; pass `next_cursor` as `cursor` for the next page (null: no more)."""

    items: list[T]
    next_cursor: str | None


#: Term name → value (load, comm, mig, and any term added since), and "total": the weighted sum.
Objective = Annotated[
    dict[str, float], Field(description="Each objective term's value by name, and `total`, their weighted sum.")
]
#: Term name → the greedy's multiplier of it (α, β, γ in Gimbal's names are comm, load and mig).
Params = Annotated[
    dict[str, float],
    Field(description="The greedy's multiplier of each objective term, by name (alpha=comm, beta=load, gamma=mig)."),
]


class Move(_Out):
    """One expert move (`MOVE_COLUMNS`); a src of -1 copies a replica in, a dst of -1 frees the slot."""

    layer: int
    expert: int
    src_gpu: int
    src_slot: int
    dst_gpu: int
    dst_slot: int


class PlacementSummary(_Out):
    id: int
    plan_id: str
    engine_group: str
    version: int
    base_version: int | None
    parent_id: int | None
    created_at: datetime
    source: Literal["greedy", "minlp", "manual", "rollback"]
    status: Literal["proposed", "published", "applied", "superseded", "rejected", "failed"]
    params: Params
    objective: Objective
    predicted_gain: float
    predicted_saving_s: float | None = Field(
        default=None,
        description="Step time (s) the layout was predicted to save over the horizon until the next plan "
        "(the step-time publish rule); null without a prediction (manual, rollback, older rows).",
    )
    predicted_cost_s: float | None = Field(
        default=None, description="Step time (s) its migration was predicted to cost (duration x slowdown share)."
    )
    measured_saving_s: float | None = Field(
        default=None,
        description="The same saving measured on the expert-load windows after the plan (null until the group "
        "is next planned): compare with predicted_saving_s.",
    )
    window_start: datetime | None
    window_end: datetime | None
    num_layers: int
    num_gpus: int
    slots_per_gpu: int
    gpus: list[str]
    details: dict[str, Any]


class MigrationSummary(_Out):
    id: int
    placement_id: int
    base_placement_id: int | None
    engine_group: str
    plan_version: int
    state: Literal["pending", "running", "succeeded", "failed", "rolling_back", "rolled_back", "refused"]
    created_at: datetime
    updated_at: datetime
    attempts: int
    error: str | None
    moves_by_state: dict[str, int] = Field(description="Move rows per state, forward and rollback together.")


class PlacementDetail(PlacementSummary):
    layout: list[list[list[int]]] | None = Field(
        description="Expert id per [layer][gpu][slot] (-1 empty); null for rejected plans stored without it."
    )
    predecessor_id: int | None = Field(description="The placement this one was planned from (null: the default).")
    diff_base: Literal["predecessor", "default"] | None = Field(
        description="What `diff` starts from: the predecessor's layout, or vLLM's contiguous default layout."
    )
    diff: list[Move] | None = Field(description="Ordered moves from `diff_base` to this layout (null: no layout).")
    migration: MigrationSummary | None


class MigrationMoveOut(_Out):
    seq: int
    step: int
    kind: Literal["forward", "rollback"]
    engine_id: str
    layer: int
    expert: int
    src_gpu: int
    src_slot: int
    dst_gpu: int
    dst_slot: int
    state: Literal["pending", "sent", "applied", "failed", "rolled_back"]
    attempts: int
    duration_s: float | None
    error: str | None


class MigrationDetail(MigrationSummary):
    moves: list[MigrationMoveOut]


class CalibrationOut(_Out):
    id: int
    created_at: datetime
    engine_group: str | None
    status: Literal["succeeded", "failed"]
    params: Params
    agreement: float
    comm_gap: float
    solve_seconds: float
    num_windows: int
    details: dict[str, Any]


class CalibrationTrigger(BaseModel):
    """Calibrate the greedy's multipliers (α, β, γ) against the MINLP on the placement service's current windows."""

    model_config = ConfigDict(extra="forbid")
    engine_group: GroupId | None = None
    time_limit_s: float = Field(default=DEFAULT_TIME_LIMIT_S, gt=0, le=600, description="CP-SAT time limit per layer.")
    layers: int | None = Field(default=None, ge=1, le=4096, description="Use only the first N layers.")


class Accepted(BaseModel):
    request_id: str
    status: Literal["queued"] = "queued"
    detail: str


class ModelOut(_Out):
    name: str
    num_layers: int
    num_experts: int
    top_k: int


class TelemetryOut(_Out):
    seq: int
    ts: float
    kv_usage: float
    num_running: int
    num_waiting: int
    waiting_prefill_tokens: int
    remaining_prefill_tokens: int
    step_time_ema: float
    expert_pressure: float
    migrating: bool


class EngineOut(BaseModel):
    engine_id: str
    role: str | None
    ep_group: str | None
    dp_rank: int | None
    gpus: list[str]
    model: ModelOut | None
    agent: str | None
    live: bool = Field(description="Heard from since the API started (hello or telemetry).")
    stale: bool = Field(description="Silent for longer than 3 of its own announced intervals (or never heard live).")
    last_seen: datetime | None
    telemetry: TelemetryOut | None
    telemetry_gaps: int = Field(description="Telemetry messages missed (sequence jumps).")
    restarts: int = Field(description="Telemetry sequence restarts seen.")


class ArtifactOut(BaseModel):
    version: int
    content_hash: str
    created_at: float
    model: ModelOut
    representation: str
    layer_mask: list[int]
    tau: float
    rho: float
    decoder_ids: list[str] | None
    num_calibration: int
    idf_shape: list[int]
    centroids_shape: list[int]
    kv_revision: int
    idf: list[list[float]] | None = Field(default=None, description="Only with include_arrays=true.")
    centroids: list[list[float]] | None = Field(default=None, description="Only with include_arrays=true.")


class Health(BaseModel):
    status: Literal["ok", "unavailable"]
    checks: dict[str, str] = {}
