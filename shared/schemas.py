"""The bus contract: one pydantic model per message in DESIGN.md's table.

Every model is validated on decode (`shared.codec.decode`), so a service only ever sees messages whose
ids are subject-safe, whose counts are non-negative and whose arrays have the declared dtype kind, rank
and mutually consistent shapes. Arrays use the `Array` annotation (see `shared.codec`).

Shapes, with L = MoE layers, E = experts per layer, S = source DP ranks, G = GPUs (EP ranks) in a group,
K = decoders (centroids), N = masked layers:

| message | arrays |
|---|---|
| ExpertLoad | expert_counts `B[L, E]`, source_counts `A[L, S, E]` (optional) |
| RouteDecodeRequest | signature `[N or L, E]` prefill top-k counts |
| PlacementPlan | placement `[L, G, slots]` expert id per slot (-1 empty), moves `[n, 6]` |
| MigrateRequest | moves `[n, 6]` |
| LayoutReply | layout `[L, G, slots]` expert id per slot (-1 empty) |
| RoutingSample | prefill_counts `[L, E]`, decode_counts `[L, E]` |
| PrefillSignature | signature `[L, E]` prompt top-k counts |
| RoutingArtifact | idf `[N, E]`, centroids `[K, N*E]` |
"""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from switchyard.shared.codec import Array, ErrorReply, WireModel
from switchyard.shared.placement_terms import (
    BUILTIN_TERMS,
    DEFAULT_TIME_LIMIT_S,
    MAX_TERMS,
    RESERVED_NAMES,
    TERM_NAME_PATTERN,
    greek_to_terms,
)

__all__ = [
    "MAX_KV_EVENT_KEYS",
    "MAX_PROMPT_BLOCKS",
    "MAX_SHARED_DECISIONS",
    "MOVE_COLUMNS",
    "AgentKind",
    "Announce",
    "CalibrationRequest",
    "Capacity",
    "ErrorReply",
    "ExpertLoad",
    "Hello",
    "KvEvents",
    "KvOp",
    "LayoutReply",
    "LayoutRequest",
    "MigrateReply",
    "MigrateRequest",
    "ModelShape",
    "ObjectiveTerms",
    "PlacementParams",
    "PlacementPlan",
    "PrefillSignature",
    "RouteDecisions",
    "RouteDecodeReply",
    "RouteDecodeRequest",
    "RouteDpReply",
    "RouteDpRequest",
    "RouteProgress",
    "RoutingArtifact",
    "RoutingSample",
    "Telemetry",
]

#: Engine and group ids become NATS subject tokens: no dots, spaces or wildcards.
EngineId = Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
RequestId = Annotated[str, Field(min_length=1, max_length=128)]
#: Bounded to what every consumer can hold: numpy int64 columns and BIGINT in the database (2**63 would raise
#: `OverflowError` in a handler, not a validation error at the door).
Count = Annotated[int, Field(ge=0, le=2**63 - 1)]
SessionKey = Annotated[str, Field(pattern=r"^(?:[0-9a-f]{16})?$")]  # a session id's hash (gateway.sessions), or ""
Positive = Annotated[int, Field(gt=0, le=2**63 - 1)]
#: Plan versions are INTEGER columns in the history database.
Version = Annotated[int, Field(gt=0, le=2**31 - 1)]
Seconds = Annotated[float, Field(ge=0.0, allow_inf_nan=False)]
#: Unix seconds up to 9999-12-31 (what `datetime` and the database hold; 1e308 is no time).
Timestamp = Annotated[float, Field(ge=0.0, le=253_402_300_799.0, allow_inf_nan=False)]
#: A plan id is stored as VARCHAR(64) and named in logs: no NUL or other control characters.
PlanId = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[^\x00-\x1f\x7f]+$")]
#: Largest layers x experts of an expert-load window (DeepSeek-V3: 58 x 256 = 14,848): a receiver keeps a
#: float64 copy per group, so a window of [2048, 4000] from an invented group cost 65 MB.
MAX_EXPERT_CELLS = 1 << 18
#: Longest interval an engine may announce between hellos: who is silent longer is gone, not resting.
MAX_HELLO_INTERVAL_S = 60.0
Fraction = Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)]
Finite = Annotated[float, Field(allow_inf_nan=False)]
Role = Literal["prefill", "decode", "dp"]
#: The engine kind behind a hello (`sim`, `vllm`, a new one such as `sglang`): an open name, so adding a kind
#: changes no schema. Lowercase, at most 16 characters (the history database's `engines.agent` column).
AgentKind = Annotated[str, Field(pattern=r"^[a-z][a-z0-9_-]{0,15}$")]
#: A served model's name (`ModelShape.name`, an OpenAI request's `model`).
ModelName = Annotated[str, Field(min_length=1, max_length=128)]

IntMatrix = Annotated[np.ndarray, Array("iu", ndim=2)]
IntCube = Annotated[np.ndarray, Array("iu", ndim=3)]
FloatMatrix = Annotated[np.ndarray, Array("f", ndim=2)]
SignedMatrix = Annotated[np.ndarray, Array("i", ndim=2)]
SignedCube = Annotated[np.ndarray, Array("i", ndim=3)]

#: Most block keys one prompt may carry (`RouteDpRequest.block_keys`): 256K tokens at vLLM's 16-token blocks.
MAX_PROMPT_BLOCKS = 16384
#: Most operations, and keys in all, one `KvEvents` message may carry (a sender splits larger batches).
MAX_KV_EVENT_KEYS = 8192
BlockKeys = Annotated[np.ndarray, Array("u", ndim=1)]

#: Most decisions one `RouteDecisions` message may carry (a sender splits larger batches).
MAX_SHARED_DECISIONS = 4096

#: Columns of a moves array (`PlacementPlan.moves`, `MigrateRequest.moves`). A src of -1 means the expert
#: is copied in as a new replica rather than moved; a dst of -1 means the slot is freed.
MOVE_COLUMNS = ("layer", "expert", "src_gpu", "src_slot", "dst_gpu", "dst_slot")


class _Part(BaseModel):
    model_config = ConfigDict(strict=True, frozen=True, extra="ignore")


class ModelShape(_Part):
    name: ModelName
    num_layers: Positive
    num_experts: Positive
    top_k: Positive

    @model_validator(mode="after")
    def _top_k_fits(self) -> ModelShape:
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k {self.top_k} exceeds num_experts {self.num_experts}")
        return self


class Capacity(_Part):
    max_running: Positive
    kv_blocks: Positive
    block_size: Positive
    #: The longest prompt plus output the engine accepts (vLLM's `max_model_len`); the gateway's `/v1/models`
    #: reports it. None: the engine does not say.
    max_model_len: Positive | None = None


class Hello(WireModel):
    """`sy.engine.<id>.hello`: who an engine is. Published on start and every `hello_interval_s`."""

    MAX_WIRE_BYTES: ClassVar[int | None] = 256 * 1024  # up to 1024 GPU names

    engine_id: EngineId
    role: Role
    model: ModelShape
    ep_group: EngineId
    dp_rank: Count = 0
    gpus: Annotated[list[str], Field(max_length=1024)]
    capacity: Capacity
    ts: Timestamp
    agent: AgentKind
    agent_version: Annotated[str, Field(max_length=64)] = ""
    #: Whether the engine applies `sy.engine.<id>.migrate` steps; the placement service plans only groups
    #: whose coordinator does (a plan for the others could only be refused).
    migrates: bool = True
    hello_interval_s: Annotated[float, Field(gt=0.0, le=MAX_HELLO_INTERVAL_S, allow_inf_nan=False)] = 5.0
    telemetry_interval_s: Annotated[float, Field(gt=0.0, le=MAX_HELLO_INTERVAL_S, allow_inf_nan=False)] = 0.1
    #: The engine's OpenAI-compatible HTTP base URL (e.g. `http://10.0.0.5:8000`), where the gateway sends the
    #: requests it routes there; None for an engine that serves no HTTP. The model it serves is `model.name`;
    #: role `dp` is a mixed (prefill and decode) engine of a data-parallel fleet.
    base_url: Annotated[str, Field(max_length=256, pattern=r"^https?://[^\s/?#]+(/[^\s?#]*)?$")] | None = None


class Telemetry(WireModel):
    """`sy.engine.<id>.telemetry`: instantaneous engine pressure, ~every 100 ms, latest value wins.

    `seq` increases by one per message from an engine's start, so consumers can detect gaps and restarts.
    """

    MAX_WIRE_BYTES: ClassVar[int | None] = 16 * 1024  # ~200 bytes in practice

    engine_id: EngineId
    seq: Count
    ts: Timestamp
    kv_usage: Fraction
    num_running: Count
    num_waiting: Count
    waiting_prefill_tokens: Count
    remaining_prefill_tokens: Count
    step_time_ema: Seconds
    expert_pressure: Annotated[float, Field(ge=0.0, allow_inf_nan=False)] = 0.0
    migrating: bool = False


def _at_least(array: np.ndarray | None, lowest: int, what: str) -> None:
    """Counts are never negative and slot maps hold -1 (empty) or an expert id: say which array broke it."""
    if array is not None and array.size and array.dtype.kind == "i" and int(array.min()) < lowest:
        raise ValueError(f"{what} holds {int(array.min())}; every entry must be >= {lowest}")


def _finite(array: np.ndarray, what: str) -> None:
    if array.size and not np.isfinite(array).all():
        raise ValueError(f"{what} holds NaN or infinity")


class ExpertLoad(WireModel):
    """`sy.engine.<id>.expert_load` (JetStream): token counts per expert over one window."""

    engine_id: EngineId
    ep_group: EngineId
    seq: Count
    window_start: Timestamp
    window_end: Timestamp
    expert_counts: IntMatrix
    source_counts: IntCube | None = None

    @model_validator(mode="after")
    def _consistent(self) -> ExpertLoad:
        if self.window_end < self.window_start:
            raise ValueError("window_end precedes window_start")
        layers, experts = self.expert_counts.shape
        if layers == 0 or experts == 0:
            raise ValueError(f"expert_counts shape {[layers, experts]} has no layer or no expert")
        if layers * experts > MAX_EXPERT_CELLS:
            raise ValueError(f"expert_counts shape {[layers, experts]} exceeds {MAX_EXPERT_CELLS} layer x expert cells")
        _at_least(self.expert_counts, 0, "expert_counts")
        _at_least(self.source_counts, 0, "source_counts")
        if self.source_counts is not None:
            layers, experts = self.expert_counts.shape
            if self.source_counts.shape[0] != layers or self.source_counts.shape[2] != experts:
                raise ValueError(
                    f"source_counts shape {list(self.source_counts.shape)} does not match "
                    f"expert_counts [{layers}, S, {experts}]"
                )
        return self


class RouteDecodeRequest(WireModel):
    """`sy.route.decode`: at the prefill->decode handoff, which decoder should take this request?

    `signature` holds top-k selection counts of the prompt's tokens; its rows are the model layers listed
    in `layers` (None: every layer in order), so a prefill agent may send only the artifact's masked
    layers or the whole `[L, E]` matrix.
    """

    request_id: RequestId
    prompt_tokens: Count
    signature: IntMatrix | None = None
    layers: list[Count] | None = None
    label: Annotated[str, Field(max_length=128)] | None = None
    prefill_engine_id: EngineId | None = None
    #: Only decoders serving this model (their hello's `model.name`) are candidates; None: any decoder.
    model: ModelName | None = None

    @model_validator(mode="after")
    def _layers_match(self) -> RouteDecodeRequest:
        if self.layers is not None:
            if self.signature is None:
                raise ValueError("layers given without a signature")
            if len(self.layers) != self.signature.shape[0]:
                raise ValueError(f"{len(self.layers)} layers listed for a signature of {self.signature.shape[0]} rows")
        _at_least(self.signature, 0, "signature")  # free for unsigned dtypes, which agents send
        return self


class RouteDecodeReply(WireModel):
    request_id: RequestId
    engine_id: EngineId
    policy: str
    band_size: Count
    decision_us: Seconds
    artifact_version: Count | None = None
    fallback: str | None = None


class RouteDecisions(WireModel):
    """`sy.route.decided`: the decisions one replica made since its previous message (≤ a few ms' worth).

    Every replica counts them in flight on the chosen engines until telemetry shows them; without that, N replicas
    routing on the same (slightly stale) telemetry all pick the same "best" engine. One entry per decision, as
    parallel columns (`sessions`: optional). Version 2: version 1 carried one decision per message.
    """

    VERSION: ClassVar[int] = 2
    v: Literal[2] = 2  # type: ignore[assignment]  # a version bump narrows `v` (WireModel checks the pair)

    replica_id: Annotated[str, Field(min_length=1, max_length=64)]
    kinds: Annotated[list[Literal["decode", "dp"]], Field(max_length=MAX_SHARED_DECISIONS)]
    request_ids: Annotated[list[RequestId], Field(max_length=MAX_SHARED_DECISIONS)]
    engine_ids: Annotated[list[EngineId], Field(max_length=MAX_SHARED_DECISIONS)]
    prompt_tokens: Annotated[list[Count], Field(max_length=MAX_SHARED_DECISIONS)]
    sessions: Annotated[list[SessionKey], Field(default_factory=list, max_length=MAX_SHARED_DECISIONS)]

    @model_validator(mode="after")
    def _same_length(self) -> RouteDecisions:
        n, s = len(self.engine_ids), len(self.sessions)
        if len({len(self.kinds), len(self.request_ids), len(self.prompt_tokens), n}) > 1 or s not in (0, n):
            raise ValueError(
                f"columns differ in length: kinds {len(self.kinds)}, request_ids {len(self.request_ids)}, "
                f"engine_ids {n}, prompt_tokens {len(self.prompt_tokens)}, sessions {s} (or none)"
            )
        return self


class RouteProgress(WireModel):
    """`sy.route.progress.<reporter>`: requests a gateway routed with ``progress`` whose first token it relayed
    (`first`) or that ended, done, failed or cancelled (`done`), since its previous message (≤ a few ms' worth).

    The routers settle their exact ledger from these (`solver.routing.exact_ledger.ExactLedger`): what an engine
    still owes is then known, not guessed from telemetry timing. An id may be in both lists (a one-token answer,
    or a batch that spans its first token and its end); the first token is applied first. Ids a router does
    not hold (another replica's decisions, a restart), or holds for another reporter, are ignored there.
    """

    first: Annotated[list[RequestId], Field(max_length=MAX_SHARED_DECISIONS)]
    done: Annotated[list[RequestId], Field(max_length=MAX_SHARED_DECISIONS)]


class Announce(WireModel):
    """`sy.engine.announce`: a (re)starting service asks engines to publish their hello now, not in 5 s.

    `engine_id` narrows the request to one engine (e.g. telemetry arrived from an engine never introduced).
    """

    MAX_WIRE_BYTES: ClassVar[int | None] = 4 * 1024

    requester: Annotated[str, Field(min_length=1, max_length=64)]
    engine_id: EngineId | None = None


class RouteDpRequest(WireModel):
    """`sy.route.dp`: which data-parallel engine should take a new request?

    `model`: only engines serving this model (their hello's `model.name`) are candidates; None: any engine
    (a message from before the field existed).
    """

    MAX_WIRE_BYTES: ClassVar[int | None] = 8 * MAX_PROMPT_BLOCKS + 4 * 1024

    request_id: RequestId
    prompt_tokens: Count
    model: ModelName | None = None
    #: The prompt's chained block keys (`shared.prefix_keys`), uint64[n] with n ≤ MAX_PROMPT_BLOCKS: over the
    #: model's tokens at the engines' block size (`key_kind` "tokens", matched against the engines' KV events)
    #: or over its text in fixed byte blocks ("text": no tokenizer at the sender; matched against what was
    #: routed). None: the sender computed none (the prefix scorers see nothing cached).
    block_keys: BlockKeys | None = None
    key_kind: Literal["tokens", "text"] = "tokens"
    #: The sender will report this request's first token and end on `sy.route.progress` (`RouteProgress`): the
    #: router then counts it in its exact ledger (`solver.routing.exact_ledger`) until those reports. False (a
    #: client that never reports, or one from before the field): counted in flight until telemetry shows it.
    progress: bool = False
    #: Who reports that progress: the sender's NATS user, on `sy.route.progress.<reporter>` (only that user may
    #: publish there). None (a sender from before the field): `progress` is not believed.
    reporter: EngineId | None = None


class RouteDpReply(WireModel):
    """`priority` is the engine-queue key: lower is served sooner (shortest prefill first, with aging)."""

    request_id: RequestId
    engine_id: EngineId
    priority: int
    decision_us: Seconds


#: A placement objective term's name (`shared.placement_terms`): a JSON key, a metric label, a log word.
TermName = Annotated[str, Field(pattern=TERM_NAME_PATTERN)]
NonNegative = Annotated[float, Field(ge=0.0, allow_inf_nan=False)]


def _no_reserved(values: dict[str, float]) -> dict[str, float]:
    if RESERVED_NAMES & values.keys():
        raise ValueError(f"{sorted(RESERVED_NAMES & values.keys())} is not a term name")
    return values


class ObjectiveTerms(_Part):
    """A plan's objective: each term's value (term name → value, e.g. load, comm, mig) and the weighted total.

    Messages written before terms became a map carried `load`, `comm` and `mig` as fields; they are read
    into `terms` (a new term needs no wire change).
    """

    terms: Annotated[dict[TermName, NonNegative], Field(max_length=MAX_TERMS)]
    total: Finite

    @model_validator(mode="before")
    @classmethod
    def _fixed_fields(cls, data: object) -> object:
        if isinstance(data, dict) and "terms" not in data:
            return {"terms": {k: data[k] for k in BUILTIN_TERMS if k in data}, "total": data.get("total")}
        return data

    @model_validator(mode="after")
    def _names(self) -> ObjectiveTerms:
        _no_reserved(self.terms)
        return self

    @classmethod
    def from_flat(cls, values: dict[str, float]) -> ObjectiveTerms:
        """From the solver's `Objective.totals()`: every term by name, and "total"."""
        return cls(terms={k: v for k, v in values.items() if k != "total"}, total=values["total"])


class PlacementParams(_Part):
    """The greedy's multiplier of each objective term (term name → multiplier; α, β, γ in Gimbal's names
    are comm, load and mig). Messages with the old fixed fields alpha, beta, gamma are read into `weights`."""

    weights: Annotated[dict[TermName, Finite], Field(max_length=MAX_TERMS)]

    @model_validator(mode="before")
    @classmethod
    def _fixed_fields(cls, data: object) -> object:
        if isinstance(data, dict) and "weights" not in data:
            return {"weights": greek_to_terms(data)}
        return data

    @model_validator(mode="after")
    def _names(self) -> PlacementParams:
        _no_reserved(self.weights)
        return self


def _check_moves(moves: np.ndarray) -> None:
    if moves.shape[1] != len(MOVE_COLUMNS):
        raise ValueError(f"moves must have {len(MOVE_COLUMNS)} columns {MOVE_COLUMNS}, got {moves.shape[1]}")
    if moves.shape[0] and (moves[:, :2] < 0).any():
        raise ValueError("moves: layer and expert must be non-negative")
    if moves.shape[0] and (moves[:, 2:] < -1).any():
        raise ValueError("moves: a GPU or slot is >= 0, or -1 (none)")


class PlacementPlan(WireModel):
    """`sy.placement.plan` (JetStream): a versioned expert placement for one engine group."""

    plan_id: PlanId
    version: Version
    engine_group: EngineId
    base_version: Annotated[int, Field(ge=0, le=2**31 - 1)] | None = None
    created_at: Timestamp
    source: Literal["greedy", "minlp", "manual", "rollback"]
    gpus: Annotated[list[str], Field(min_length=1, max_length=1024)]
    placement: SignedCube
    moves: SignedMatrix
    objective: ObjectiveTerms
    params: PlacementParams
    predicted_gain: Finite = 0.0

    @model_validator(mode="after")
    def _consistent(self) -> PlacementPlan:
        if self.placement.shape[1] != len(self.gpus):
            raise ValueError(f"placement has {self.placement.shape[1]} GPUs but {len(self.gpus)} are named")
        _at_least(self.placement, -1, "placement")
        _check_moves(self.moves)
        return self


class MigrateRequest(WireModel):
    """`sy.engine.<id>.migrate`: apply one ordered batch of moves of a plan (idempotent per plan+step)."""

    plan_id: PlanId
    version: Version
    engine_group: EngineId
    step: Count
    moves: SignedMatrix

    @model_validator(mode="after")
    def _consistent(self) -> MigrateRequest:
        _check_moves(self.moves)
        return self


class MigrateReply(WireModel):
    plan_id: PlanId
    version: Version
    step: Count
    applied: Count
    duration_s: Seconds
    failure: str | None = None

    @classmethod
    def refusal(cls, request: MigrateRequest, reason: str) -> MigrateReply:
        """The answer of an engine that applied nothing of `request`, saying why."""
        step = {"plan_id": request.plan_id, "version": request.version, "step": request.step}
        return cls.model_validate({**step, "applied": 0, "duration_s": 0.0, "failure": reason})


class LayoutRequest(WireModel):
    """`sy.engine.<id>.layout`: which expert sits in which slot of the engine's EP group right now."""

    engine_group: EngineId


class LayoutReply(WireModel):
    """The group's live slot map, so plans start from what the engines run, not from what the database says.

    `version` is the highest plan version the group applied since its engines started (0: none yet: the
    engines run their boot layout), `plan_id` that plan's id.
    """

    engine_group: EngineId
    layout: SignedCube
    version: Count = 0
    plan_id: Annotated[str, Field(max_length=64)] | None = None

    @model_validator(mode="after")
    def _slots(self) -> LayoutReply:
        _at_least(self.layout, -1, "layout")
        return self


class RoutingSample(WireModel):
    """`sy.routing.samples` (JetStream `SY_ROUTING_SAMPLES`): one finished request's prefill and decode expert
    counts, the training data of the ELDR routing fit (`switchyard fit --from-stream`). Called
    `CalibrationSample` on `sy.calibration.samples` before; the message itself did not change."""

    engine_id: EngineId
    request_id: RequestId
    ts: Timestamp
    prompt_tokens: Count
    decode_tokens: Count
    prefill_counts: IntMatrix
    decode_counts: IntMatrix
    label: Annotated[str, Field(max_length=128)] | None = None

    @model_validator(mode="after")
    def _same_shape(self) -> RoutingSample:
        if self.prefill_counts.shape != self.decode_counts.shape:
            raise ValueError(
                f"prefill_counts {list(self.prefill_counts.shape)} and decode_counts "
                f"{list(self.decode_counts.shape)} differ"
            )
        return self


class PrefillSignature(WireModel):
    """`sy.engine.<id>.signature`: one request's prefill expert signature, published when its prefill ends.

    The carrier from an engine whose counts live in a worker process (vLLM) to the gateway, which waits for
    it, keyed by `request_id`, before asking `sy.route.decode` (ELDR's handoff). `request_id` is the id the
    engine gives the request; vLLM builds it from the client's `X-Request-Id` header, so the gateway matches
    on the token it sent. `signature` sums the `[L, E]` top-k counts of every prompt token, including the
    `cached_tokens` served from the prefix cache (the engine keeps their counts per KV block).
    """

    engine_id: EngineId
    request_id: RequestId
    ts: Timestamp
    prompt_tokens: Count
    cached_tokens: Count = 0
    signature: IntMatrix

    @model_validator(mode="after")
    def _counts(self) -> PrefillSignature:
        _at_least(self.signature, 0, "signature")
        if self.cached_tokens > self.prompt_tokens:
            raise ValueError(f"cached_tokens {self.cached_tokens} exceeds prompt_tokens {self.prompt_tokens}")
        return self


class CalibrationRequest(WireModel):
    """`sy.placement.calibrate` (JetStream): ask the placement service to calibrate (α, β, γ) on its live windows.

    Written by the API's `POST /v1/calibrations`; the result is a `calibrations` row whose details carry
    `request_id`. `engine_group` None calibrates on every group's window (of the most common GPU count).
    """

    request_id: Annotated[str, Field(min_length=1, max_length=64)]
    requested_at: Timestamp
    engine_group: EngineId | None = None
    time_limit_s: Annotated[float, Field(gt=0.0, le=600.0, allow_inf_nan=False)] = DEFAULT_TIME_LIMIT_S
    layers: Annotated[int, Field(ge=1, le=4096)] | None = None


class RoutingArtifact(WireModel):
    """KV bucket `sy-router`, key `artifact`: the offline ELDR fit the router scores signatures against."""

    version: Version
    content_hash: Annotated[str, Field(pattern=r"^[0-9a-f]{16,64}$")]
    created_at: Timestamp
    model: ModelShape
    representation: Annotated[str, Field(min_length=1, max_length=32)]
    layer_mask: Annotated[list[Count], Field(min_length=1)]
    idf: FloatMatrix
    centroids: FloatMatrix
    tau: Annotated[float, Field(ge=0.0, le=2.0, allow_inf_nan=False)] = 0.1
    rho: Annotated[float, Field(ge=-1.0, le=1.0, allow_inf_nan=False)]
    decoder_ids: list[EngineId] | None = None
    num_calibration: Count = 0
    #: HMAC-SHA256 by the fit job (`services.artifacts.sign_artifact`); required by routers given a key.
    signature: Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")] | None = None

    @model_validator(mode="after")
    def _consistent(self) -> RoutingArtifact:
        n, e = len(self.layer_mask), self.model.num_experts
        if max(self.layer_mask) >= self.model.num_layers:
            raise ValueError(f"layer_mask names layer {max(self.layer_mask)} of a {self.model.num_layers}-layer model")
        if self.idf.shape != (n, e):
            raise ValueError(f"idf shape {list(self.idf.shape)} is not [{n}, {e}]")
        if self.centroids.shape[1] != n * e:
            raise ValueError(f"centroids have {self.centroids.shape[1]} columns, expected {n * e}")
        if self.decoder_ids is not None and len(self.decoder_ids) != self.centroids.shape[0]:
            raise ValueError(f"{len(self.decoder_ids)} decoder ids for {self.centroids.shape[0]} centroids")
        _finite(self.idf, "idf")
        _finite(self.centroids, "centroids")
        return self


class KvOp(_Part):
    """One KV-cache change: blocks `stored` or `removed` (their keys) in a cache `tier` (absent: gpu, the engine's
    KV cache; cpu, disk: offload tiers, vLLM's `medium`), or every block of every tier `cleared` (no keys)."""

    MAX_WIRE_BYTES: ClassVar[int | None] = None

    kind: Literal["stored", "removed", "cleared"]
    keys: BlockKeys
    tier: Literal["gpu", "cpu", "disk"] | None = None

    @model_validator(mode="after")
    def _keys_fit(self) -> KvOp:
        if len(self.keys) > MAX_KV_EVENT_KEYS:
            raise ValueError(f"{len(self.keys)} keys in one op, at most {MAX_KV_EVENT_KEYS}")
        if self.kind == "cleared" and (len(self.keys) or self.tier is not None):
            raise ValueError("a 'cleared' op carries no keys and no tier (it clears every tier)")
        return self


class KvEvents(WireModel):
    """`sy.engine.<id>.kv`: what an engine's prefix cache stored, evicted or cleared, in order.

    Keys are Switchyard's chained block keys (`shared.prefix_keys.block_keys` at `block_size`), not the engine's
    hashes: the relay beside vLLM translates its `BlockStored`/`BlockRemoved`/`AllBlocksCleared`, so a router names
    a request's blocks from its tokens. `seq` is +1 per message of one process: a gap means events were lost.
    """

    MAX_WIRE_BYTES: ClassVar[int | None] = 8 * MAX_KV_EVENT_KEYS + 16 * 1024

    engine_id: EngineId
    seq: Count
    ts: Timestamp
    block_size: Positive
    ops: Annotated[list[KvOp], Field(max_length=1024)]

    @model_validator(mode="after")
    def _bounded(self) -> KvEvents:
        total = sum(len(op.keys) for op in self.ops)
        if total > MAX_KV_EVENT_KEYS:
            raise ValueError(f"{total} keys in one message, at most {MAX_KV_EVENT_KEYS}")
        return self
