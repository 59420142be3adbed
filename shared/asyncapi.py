"""The bus contract as an AsyncAPI 3.0.0 document (`switchyard asyncapi`, committed as infra/asyncapi.json).

Built from `shared.subjects` (the addresses) and the wire models (the payloads), so a subscriber reads what the
code speaks; `tests/test_asyncapi.py` checks the committed file is current and valid. Payloads are msgpack, not
JSON: each schema describes the decoded map, arrays as `shared.codec.array_to_wire` maps. Senders and receivers
are operations tagged with the NATS role (`shared.nats_auth`) that does it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import metadata
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from switchyard.shared import schemas
from switchyard.shared.codec import ErrorReply, WireJsonSchema
from switchyard.shared.subjects import Subjects

CONTENT_TYPE = "application/msgpack"
#: Messages the simulated fleet defines (`engine_agents.sim.live.protocol`, a layer above): the caller passes them.
SIM_MESSAGES = ("SimSubmit", "SimCompleted")
#: Ids that stand for a channel parameter while a `Subjects` method builds the address (they pass `check_token`).
_PLACEHOLDER = re.compile(r"__([a-z_]+?)__")
_PARAMETERS = {
    "engine_id": "An engine's id (`Hello.engine_id`): [A-Za-z0-9_-]{1,64}.",
    "replica_id": "The deciding replica's id (`RouteDecisions.replica_id`, checked against it): [A-Za-z0-9_-]{1,64}.",
    "reporter": "The reporting gateway's NATS user (`gateway-<id>`, or the shared `gateway`), named by its asks "
    "(`RouteDpRequest.reporter`).",
}
_ENGINE_READERS = ("router", "gateway", "placement", "migration", "fit", "api", "readonly")
_ANNOUNCERS = ("router", "gateway", "placement", "migration", "fit", "api", "readonly")

_INTRO = """\
Every NATS subject, stream and bucket of one Switchyard deployment (subject prefix `{prefix}`), generated from
`shared/subjects.py` and the wire models (`shared/schemas.py`) by `switchyard asyncapi`.

Payloads are **msgpack** maps, not JSON: each payload schema describes the decoded map. Every message carries
its schema version `v`; a receiver refuses another version, ignores unknown keys, and validates every field.
Numeric arrays travel as `{{"dtype": "<u2", "shape": [L, E], "data": <bin>}}`: the numpy dtype string
(little-endian), the shape, and the raw C-order bytes as a msgpack bin (`shared.codec.array_to_wire`), never
as lists. Request/reply subjects answer an `ErrorReply` instead when they cannot serve a request.

Operations are tagged with the NATS role that performs them (`switchyard nats-config`, docs/security.md):
subscribe to the telemetry topics with the `readonly` role. JetStream streams, KV buckets and durable
consumers are named in each channel's `x-switchyard-carrier` and listed in `x-switchyard-streams` and
`x-switchyard-kv-buckets`.
"""


@dataclass(frozen=True)
class _Channel:
    """One subject family: its messages, who publishes it and who reads it, and how it is carried."""

    id: str
    address: str
    messages: tuple[str, ...]
    description: str
    senders: tuple[str, ...]
    receivers: tuple[str, ...]
    replies: tuple[str, ...] = ()
    subscribe: str | None = None
    carrier: Mapping[str, Any] | None = None
    queue: str | None = None


def _param(name: str) -> str:
    return f"__{name}__"


_CORE = {"transport": "core NATS"}


def _stream(name: str, **more: str) -> dict[str, Any]:
    return {"transport": "JetStream", "stream": name, **more}


def _channels(s: Subjects) -> list[_Channel]:
    """Every channel of the contract: what engines say and are told, then what the services exchange."""
    return [*_engine_channels(s), *_service_channels(s)]


def _engine_channels(s: Subjects) -> list[_Channel]:
    """The engines' subjects: what each says about itself, and what the services ask of it."""
    e = _param("engine_id")
    return [
        _Channel(
            "engineHello",
            s.hello(e),
            ("Hello",),
            "Who an engine is: on start, every `hello_interval_s`, and when a service asks (announce).",
            senders=("engine", "fleet"),
            receivers=_ENGINE_READERS,
            subscribe=s.all_hello,
            carrier=_CORE,
        ),
        _Channel(
            "engineTelemetry",
            s.telemetry(e),
            ("Telemetry",),
            "An engine's instantaneous pressure, ~every 100 ms; latest value wins.",
            senders=("engine", "fleet"),
            receivers=("router", "gateway", "migration", "api", "readonly"),
            subscribe=s.all_telemetry,
            carrier=_CORE,
        ),
        _Channel(
            "engineSignature",
            s.signature(e),
            ("PrefillSignature",),
            "A prefill engine's expert signature of one request, for the gateway's prefill->decode handoff.",
            senders=("engine",),
            receivers=("gateway",),
            subscribe=s.all_signatures,
            carrier=_CORE,
        ),
        _Channel(
            "engineKvEvents",
            s.kv_events(e),
            ("KvEvents",),
            "What an engine's prefix cache stored, evicted or cleared, in Switchyard's block keys.",
            senders=("engine",),
            receivers=("router", "gateway"),
            subscribe=s.all_kv_events,
            carrier=_CORE,
        ),
        _Channel(
            "engineExpertLoad",
            s.expert_load(e),
            ("ExpertLoad",),
            "Token counts per expert over one window, followed by the placement service (a vLLM engine core also "
            "reads its own worker's back).",
            senders=("engine", "fleet"),
            receivers=("placement", "engine"),
            subscribe=s.all_expert_load,
            carrier=_stream(s.expert_load_stream),
        ),
        _Channel(
            "engineAnnounce",
            s.announce,
            ("Announce",),
            "A (re)starting service asks every engine, or the one named, to publish its hello now.",
            senders=_ANNOUNCERS,
            receivers=("engine", "fleet"),
            carrier=_CORE,
        ),
        _Channel(
            "engineMigrate",
            s.migrate(e),
            ("MigrateRequest",),
            "One ordered batch of a plan's moves, sent to the group's coordinator engine.",
            senders=("migration",),
            receivers=("engine", "fleet"),
            replies=("MigrateReply",),
            carrier=_CORE,
        ),
        _Channel(
            "engineLayout",
            s.layout(e),
            ("LayoutRequest",),
            "The group's live slot map, asked of its coordinator engine.",
            senders=("placement", "migration"),
            receivers=("engine", "fleet"),
            replies=("LayoutReply",),
            carrier=_CORE,
        ),
    ]


def _service_channels(s: Subjects) -> list[_Channel]:
    """Between the services: routing samples, plans, route requests and decisions, the artifact, the sim fleet."""
    e, r = _param("engine_id"), _param("replica_id")
    return [
        _Channel(
            "routingSamples",
            s.routing_samples,
            ("RoutingSample",),
            "Finished requests' prefill and decode expert counts: the ELDR refit's training data.",
            senders=("engine", "fleet"),
            receivers=("fit",),
            carrier=_stream(s.routing_samples_stream),
        ),
        _Channel(
            "legacyRoutingSamples",
            s.legacy_routing_samples,
            ("RoutingSample",),
            "The routing samples' subject before the rename (`CalibrationSample`, the same map): read by "
            "`switchyard fit` where a deployed bus still holds it, written by no one.",
            senders=(),
            receivers=("fit",),
            carrier=_stream(s.legacy_routing_samples_stream),
        ),
        _Channel(
            "placementPlan",
            s.placement_plan,
            ("PlacementPlan",),
            "Versioned expert placements (msg-id: the plan id), applied by the migration service.",
            senders=("placement", "api"),
            receivers=("migration",),
            carrier=_stream(s.placement_stream, durable=s.migration_plans.name),
        ),
        _Channel(
            "calibrationRequest",
            s.calibration_request,
            ("CalibrationRequest",),
            "The API's calibration triggers (msg-id: the request id), served by the placement service.",
            senders=("api",),
            receivers=("placement",),
            carrier=_stream(s.placement_stream, durable=s.calibration_requests.name),
        ),
        _Channel(
            "routeDecode",
            s.route_decode,
            ("RouteDecodeRequest",),
            "Which decoder takes a request at the prefill->decode handoff (ELDR), answered by one router replica.",
            senders=("gateway", "fleet"),
            receivers=("router",),
            replies=("RouteDecodeReply",),
            carrier=_CORE,
            queue=s.router_queue,
        ),
        _Channel(
            "routeDp",
            s.route_dp,
            ("RouteDpRequest",),
            "Which data-parallel engine takes a new request, answered by one router replica (a gateway asks with "
            "`--router remote`).",
            senders=("gateway",),
            receivers=("router",),
            replies=("RouteDpReply",),
            carrier=_CORE,
            queue=s.router_queue,
        ),
        _Channel(
            "routeDecidedRouter",
            s.decided("router", r),
            ("RouteDecisions",),
            "A router replica's latest decisions, under its own id, so every replica counts them in flight.",
            senders=("router",),
            receivers=("router", "gateway", "readonly"),
            subscribe=s.route_decided,
            carrier=_CORE,
        ),
        _Channel(
            "routeDecidedGateway",
            s.decided("gateway", r),
            ("RouteDecisions",),
            "An in-process gateway's latest decisions, under its own id (only its user `gateway-<id>` may).",
            senders=("gateway",),
            receivers=("router", "gateway", "readonly"),
            subscribe=s.route_decided,
            carrier=_CORE,
        ),
        _Channel(
            "routeProgress",
            s.progress(_param("reporter")),
            ("RouteProgress",),
            "First tokens and ends of the requests a gateway routed with `progress`: the routers' exact ledger. Each "
            "gateway user reports on its own subject; a router applies a report only to requests asked in that "
            "reporter's name.",
            senders=("gateway",),
            receivers=("router",),
            subscribe=s.route_progress,
            carrier=_CORE,
        ),
        _Channel(
            "routingArtifact",
            f"$KV.{s.router_bucket}.{s.artifact_key}",
            ("RoutingArtifact",),
            f"The offline ELDR fit the routers score signatures against: key `{s.artifact_key}` of KV bucket "
            f"`{s.router_bucket}`, written by `switchyard fit`, read with KV gets (no subscription).",
            senders=("fit",),
            receivers=("router", "gateway", "api"),
            carrier={
                "transport": "JetStream KV",
                "bucket": s.router_bucket,
                "key": s.artifact_key,
                "stream": f"KV_{s.router_bucket}",
            },
        ),
        _Channel(
            "simSubmit",
            s.sim_submit(e),
            ("SimSubmit",),
            "Simulated fleet only: a load generator's request for a simulated prefill engine.",
            senders=("loadgen",),
            receivers=("fleet",),
            subscribe=f"{s.prefix}.sim.submit.*",
            carrier=_CORE,
        ),
        _Channel(
            "simCompleted",
            s.sim_completed,
            ("SimCompleted",),
            "Simulated fleet only: a finished request and its latencies in simulated seconds.",
            senders=("fleet",),
            receivers=("loadgen", "readonly"),
            carrier=_CORE,
        ),
    ]


def _address(subject: str) -> tuple[str, list[str]]:
    return _PLACEHOLDER.sub(r"{\1}", subject), _PLACEHOLDER.findall(subject)


def _summary(model: type[BaseModel]) -> str | None:
    doc = (model.__doc__ or "").strip()
    return doc.split("\n\n")[0].replace("\n", " ") if doc else None


def _message(model: type[BaseModel]) -> dict[str, Any]:
    message: dict[str, Any] = {
        "name": model.__name__,
        "title": model.__name__,
        "contentType": CONTENT_TYPE,
        "payload": {"$ref": f"#/components/schemas/{model.__name__}"},
        "x-switchyard-version": getattr(model, "VERSION", 1),
    }
    if summary := _summary(model):
        message["summary"] = summary
    if limit := getattr(model, "MAX_WIRE_BYTES", None):
        message["x-switchyard-max-bytes"] = limit
    return message


def _channel(ch: _Channel) -> dict[str, Any]:
    address, params = _address(ch.address)
    channel: dict[str, Any] = {
        "address": address,
        "description": ch.description,
        "messages": {name: {"$ref": f"#/components/messages/{name}"} for name in ch.messages},
    }
    if params:
        channel["parameters"] = {p: {"description": _PARAMETERS[p]} for p in params}
    if ch.subscribe:
        channel["x-switchyard-subscribe"] = ch.subscribe
    if ch.carrier:
        channel["x-switchyard-carrier"] = dict(ch.carrier)
    return channel


def _reply_channel(ch: _Channel) -> dict[str, Any]:
    names = (*ch.replies, ErrorReply.__name__)
    return {
        "address": None,
        "description": f"The answer to `{_address(ch.address)[0]}`, on the request's NATS reply subject (the "
        "requester's inbox): the reply, or an `ErrorReply` naming the field at fault.",
        "messages": {name: {"$ref": f"#/components/messages/{name}"} for name in names},
    }


def _operations(ch: _Channel) -> dict[str, dict[str, Any]]:
    ref = {"$ref": f"#/channels/{ch.id}"}
    messages = [{"$ref": f"#/channels/{ch.id}/messages/{name}"} for name in ch.messages]
    reply = None
    if ch.replies:
        reply_id = f"{ch.id}Reply"
        reply = {
            "channel": {"$ref": f"#/channels/{reply_id}"},
            "messages": [
                {"$ref": f"#/channels/{reply_id}/messages/{name}"} for name in (*ch.replies, ErrorReply.__name__)
            ],
        }
    ops: dict[str, dict[str, Any]] = {}
    for action, roles in (("send", ch.senders), ("receive", ch.receivers)):
        if not roles:
            continue
        op: dict[str, Any] = {
            "action": action,
            "channel": ref,
            "messages": messages,
            "summary": f"{', '.join(roles)} {action}{'s' if len(roles) == 1 else ''} on {_address(ch.address)[0]}",
            "tags": [{"name": role} for role in roles],
        }
        if reply:
            op["reply"] = reply
        if action == "receive" and ch.queue:
            op["bindings"] = {"nats": {"queue": ch.queue, "bindingVersion": "0.1.0"}}
        ops[f"{action}{ch.id[0].upper()}{ch.id[1:]}"] = op
    return ops


def _models(extra: Mapping[str, type[BaseModel]]) -> dict[str, type[BaseModel]]:
    models: dict[str, type[BaseModel]] = {name: getattr(schemas, name) for name in schemas.__all__}
    models = {name: m for name, m in models.items() if isinstance(m, type) and issubclass(m, BaseModel)}
    return {**models, **extra}


def build(sim_messages: Mapping[str, type[BaseModel]], subjects: Subjects | None = None) -> dict[str, Any]:
    """The AsyncAPI document (a JSON-ready dict) of the bus under `subjects` (default prefix `sy`).

    `sim_messages`: the simulated fleet's models, by name (`SIM_MESSAGES`), which `shared` may not import."""
    missing = set(SIM_MESSAGES) - sim_messages.keys()
    if missing:
        raise ValueError(f"sim_messages lacks {sorted(missing)}")
    s = subjects or Subjects()
    models = _models(sim_messages)
    table = _channels(s)
    used = sorted({name for ch in table for name in (*ch.messages, *ch.replies)} | {ErrorReply.__name__})
    unknown = [name for name in used if name not in models]
    if unknown:
        raise ValueError(f"channels name messages without a model: {unknown}")
    _, defs = models_json_schema(
        [(models[name], "validation") for name in used],
        ref_template="#/components/schemas/{model}",
        schema_generator=WireJsonSchema,
    )
    channels: dict[str, Any] = {}
    operations: dict[str, Any] = {}
    for ch in table:
        channels[ch.id] = _channel(ch)
        if ch.replies:
            channels[f"{ch.id}Reply"] = _reply_channel(ch)
        operations.update(_operations(ch))
    roles = sorted({role for ch in table for role in (*ch.senders, *ch.receivers)})
    return {
        "asyncapi": "3.0.0",
        "info": {
            "title": "Switchyard bus",
            "version": metadata.version("switchyard"),
            "description": _INTRO.format(prefix=s.prefix),
            "license": {"name": "Apache-2.0", "url": "https://www.apache.org/licenses/LICENSE-2.0"},
            "tags": [{"name": role, "description": f"NATS role `{role}`"} for role in roles],
        },
        "defaultContentType": CONTENT_TYPE,
        "servers": {
            "embedded": {
                "host": "127.0.0.1:4222",
                "protocol": "nats",
                "description": "The server `switchyard up` embeds; a deployment's is SWITCHYARD_NATS_URL.",
            }
        },
        "channels": channels,
        "operations": operations,
        "x-switchyard-streams": {
            **s.streams(),
            s.legacy_routing_samples_stream: [s.legacy_routing_samples],
            f"KV_{s.router_bucket}": [f"$KV.{s.router_bucket}.>"],
        },
        "x-switchyard-kv-buckets": {
            s.router_bucket: "The routing artifact (channel routingArtifact).",
            s.lease_bucket: "Group leases of the placement and migration replicas: no message of the contract.",
        },
        "components": {
            "messages": {name: _message(models[name]) for name in used},
            "schemas": defs.get("$defs", {}),
        },
    }


def render(document: Mapping[str, Any]) -> str:
    """The committed form: JSON, keys sorted, two-space indent, UTF-8, a final newline (stable diffs)."""
    return json.dumps(document, indent=2, sort_keys=True, ensure_ascii=False) + "\n"
