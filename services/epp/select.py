"""`POST /v1/select`: the picker's choice for a proxy that is not Envoy, as AIBrix's external routing protocol asks it.

AIBrix's gateway (`routing-strategy: external`) sends a `ReplicaSelectionRequest` (`routing.aibrix.ai/v1alpha1`):
the model it already chose and a snapshot of the candidate pods it allows, each as `namespace/pod-name` with its
ports, never an IP, a prompt or a body. The answer is a `ReplicaSelectionResponse` naming one candidate and one
of its ports (`Selected`), or none: `NoDecision` in `Advisory` mode (AIBrix then runs its own fallback) and
`Denied` in `Authoritative` mode (AIBrix answers its client 403). AIBrix treats `Denied` in Advisory mode and
`NoDecision` in Authoritative mode as protocol failures, so the picker answers each mode with the one it allows.

Candidates are matched to the engines the picker knows from their hellos: an engine is a candidate's when its id
is the pod's name, or the pod's name followed by `-dp<rank>` (the vLLM agent's default id is `<hostname>-dp<rank>`,
and a pod's hostname is its name), and its `base_url` port is one of the candidate's ports. Data-parallel ranks
behind one pod are told apart by that port.

The choice is the router core's over the model's fleet when every live engine of the model is a candidate, else
the least outstanding candidate (as the picker's subset hint is decided, docs/epp.md); either way it is counted in
the core and shared with the other replicas as a decision whose end nobody reports (telemetry settles it, as it
settles other replicas' decisions). No prompt comes, so no prefix locality: that needs the Envoy path.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from switchyard.services.epp import metrics
from switchyard.services.epp.picker import EndpointPicker
from switchyard.services.gateway.registry import HttpEngine
from switchyard.services.gateway.signatures import new_request_id
from switchyard.services.router.ask import LocalDpAsk
from switchyard.services.router.core import Decided
from switchyard.shared import json_depth

API_VERSION = "routing.aibrix.ai/v1alpha1"
#: AIBrix sends this media type and accepts an answer only in it.
MEDIA_TYPE = "application/vnd.aibrix.external-routing+json;version=v1alpha1"
#: AIBrix's own default bound on what it sends (`AIBRIX_EXTERNAL_ROUTER_MAX_REQUEST_BYTES`, 256 KiB).
MAX_REQUEST_BYTES = 256 * 1024
#: Candidates one request may name (AIBrix sends one per pod of the model).
MAX_CANDIDATES = 4096

_Port = Annotated[int, Field(ge=1, le=65535)]
_Text = Annotated[str, Field(min_length=1, max_length=256)]


class _Loose(BaseModel):
    """Fields this side does not read (attributes, metrics, policy context) are ignored, as the protocol's alpha
    evolution asks."""

    model_config = ConfigDict(extra="ignore", frozen=True)


class Candidate(_Loose):
    id: Annotated[str, Field(min_length=1, max_length=512)]
    ports: Annotated[list[_Port], Field(min_length=1, max_length=64)]


class Spec(_Loose):
    model: _Text
    policyMode: Literal["Advisory", "Authoritative"]  # the protocol's field names (camelCase)
    candidates: Annotated[list[Candidate], Field(min_length=1, max_length=MAX_CANDIDATES)]


class Metadata(_Loose):
    requestId: _Text


class SelectionRequest(_Loose):
    apiVersion: Literal["routing.aibrix.ai/v1alpha1"]
    kind: Literal["ReplicaSelectionRequest"]
    metadata: Metadata
    spec: Spec


class BadSelection(ValueError):
    """A request refused with 400 (`reason`: the label it is counted under)."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


def parse_selection(raw: bytes) -> SelectionRequest:
    """The request, validated; `BadSelection` names what is wrong (the first problem's field path)."""
    try:
        document = json_depth.loads(raw)
    except json_depth.TooDeep as exc:
        raise BadSelection(str(exc), "too_deep") from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise BadSelection(f"request body is not valid JSON: {exc}", "not_json") from None
    if not isinstance(document, dict):
        raise BadSelection("request body must be a JSON object", "not_object")
    try:
        return SelectionRequest.model_validate(document)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "body"
        raise BadSelection(f"{where}: {first['msg']}", "invalid") from None


def owns(engine_id: str, pod: str) -> bool:
    """Whether `engine_id` is the pod's engine: the pod's name, or it followed by `-dp<rank>`."""
    if engine_id == pod:
        return True
    rank = engine_id.removeprefix(pod + "-dp")
    return rank != engine_id and rank.isdigit()


class Selector:
    """`ReplicaSelectionRequest` in, `ReplicaSelectionResponse` out (the module docstring), on the picker's view."""

    def __init__(self, picker: EndpointPicker) -> None:
        self.picker = picker

    def _port(self, engine: HttpEngine) -> int:
        return int(self.picker.endpoint(engine).rsplit(":", 1)[1])

    def matched(self, spec: Spec, live: list[HttpEngine]) -> dict[str, tuple[HttpEngine, Candidate]]:
        """Engine id -> (engine, its candidate), for the live engines of the model that some candidate is."""
        out: dict[str, tuple[HttpEngine, Candidate]] = {}
        for candidate in spec.candidates:
            pod = candidate.id.rsplit("/", 1)[-1]
            ports = set(candidate.ports)
            for engine in live:
                if engine.engine_id not in out and owns(engine.engine_id, pod) and self._port(engine) in ports:
                    out[engine.engine_id] = (engine, candidate)
        return out

    def select(self, request: SelectionRequest) -> dict[str, Any]:
        spec = request.spec
        live = self.picker.registry.live("dp", spec.model)
        matched = self.matched(spec, live)
        if not matched:
            return self._none(request, "NoLiveCandidate")
        engines = [engine for engine, _ in matched.values()]
        bound = self.picker.settings.shed_load
        if bound and all(self.picker.load(e) >= bound for e in engines):
            return self._none(request, "AtLoadBound")
        decision_id = "syepp-" + new_request_id().removeprefix("sygw-")
        engine_id = self._choose(decision_id, spec.model, engines, whole_fleet=len(engines) == len(live))
        engine, candidate = matched[engine_id]
        metrics.SELECTIONS.labels("selected").inc()
        return _response(
            request,
            {"decision": "Selected", "target": {"id": candidate.id, "port": self._port(engine)}},
            decision_id,
        )

    def _choose(self, decision_id: str, model: str, engines: list[HttpEngine], whole_fleet: bool) -> str:
        """The core's choice over the model's fleet, else (or when the core has none) the least outstanding
        candidate; counted in flight without an id (no end will be reported) and shared."""
        core = self.picker.feed.core
        now = time.monotonic()
        if whole_fleet:
            _reply, decided = core.route_dp(LocalDpAsk(decision_id, 1, model, None, "tokens", False), now)
            if decided is not None and decided.engine_id in {e.engine_id for e in engines}:
                self._share(decided)
                return decided.engine_id
        engine = min(engines, key=lambda e: (self.picker.load(e), e.engine_id))
        row = core.fleet.index.get(engine.engine_id)
        if row is not None:
            core.fleet.on_decision_row(row, 1, now)
            core.dp.record_decision(row, 1)
            core.decode.record_decision(row, 1)
            self._share(Decided("dp", decision_id, engine.engine_id, 1))
        return engine.engine_id

    def _share(self, decided: Decided) -> None:
        sharer = self.picker.sharer
        if sharer is not None:
            sharer.add(decided)
            sharer.idle()

    @staticmethod
    def _none(request: SelectionRequest, reason: str) -> dict[str, Any]:
        """No candidate can take it: the answer the request's policy mode allows."""
        if request.spec.policyMode == "Authoritative":
            metrics.SELECTIONS.labels("denied").inc()
            return _response(request, {"decision": "Denied", "reason": reason})
        metrics.SELECTIONS.labels("no_decision").inc()
        return _response(request, {"decision": "NoDecision", "reason": reason})


def _response(request: SelectionRequest, status: dict[str, Any], decision_id: str | None = None) -> dict[str, Any]:
    metadata = {"requestId": request.metadata.requestId}
    if decision_id is not None:
        metadata["decisionId"] = decision_id
    return {"apiVersion": API_VERSION, "kind": "ReplicaSelectionResponse", "metadata": metadata, "status": status}
