"""One registry of engine signals: every per-engine number routing reads, named once.

A *signal* is one engine column of the routing framework's `FleetSnapshot` (`solver.routing.snapshot`): what a
filter, scorer or picker lists in its `needs`, and what `snap.column(name)` returns. Its entry says where the
number comes from (`producer`: a `Telemetry` field, the router's in-flight ledger, the router's clock), its
unit, how stale it may be, the telemetry view's column that stores it (`view`, for a signal copied from a
message field) and the value of a row no engine has filled yet (`fill`). *Request inputs* (the request's
similarities, label, prompt tokens) are not engine columns; they are named in `REQUEST_INPUTS`.

Users, each reading this table rather than repeating the names:

- routing parts declare `needs = need("kv_usage", ...)`: a misspelt or unknown name fails when the part's
  class is defined (at import), and a `Profile` checks its parts' needs again when it is built;
- the router's telemetry view (`services.router.telemetry_view`) allocates one column per signal with a
  `view`, and the router (`services.router.core`) gathers a signal copied from a message field with no code
  of its own;
- the DP simulator's dispatcher (`simulator.offline.dp`) names the signals it feeds through `need`.

Adding a signal is one entry here plus its producer: the message field (`shared.schemas.Telemetry`) and the
line of `TelemetryView.on_telemetry` that stores it (docs/architecture.md, "How to add a decode scorer").
Pure data: no I/O.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

import numpy as np

from switchyard.shared.schemas import Telemetry

__all__ = [
    "PER_DECISION",
    "PER_REPORT_AND_DECISION",
    "PER_TELEMETRY",
    "REQUEST_INPUTS",
    "SIGNALS",
    "RequestInput",
    "Signal",
    "UnknownSignal",
    "need",
    "telemetry_view_columns",
]

#: Staleness: a value reported by the engine, as old as its last telemetry (~100 ms, `sy.engine.<id>.telemetry`).
PER_TELEMETRY = "per telemetry report"
#: Staleness: the router's own count, current at every decision (this replica's and the others' decisions).
PER_DECISION = "per decision"
#: Staleness: a reported value the router corrects at every decision (the in-flight compensation).
PER_REPORT_AND_DECISION = f"{PER_TELEMETRY}, corrected {PER_DECISION}"


@dataclass(frozen=True)
class Signal:
    """One per-engine signal. `name` is the `FleetSnapshot` column routing parts read (`needs`)."""

    name: str
    producer: str  # where the value comes from: "Telemetry.<field>", "router ledger", ...
    unit: str
    staleness: str
    view: str | None = None  # the telemetry view's column storing the producer's field (None: derived)
    dtype: type = np.float64
    fill: float = 0.0  # the value of a row no report has filled yet
    doc: str = ""

    @property
    def field(self) -> str | None:
        """The `Telemetry` field the signal is copied from, if it is one."""
        kind, _, name = self.producer.partition(".")
        return name if kind == "Telemetry" else None


@dataclass(frozen=True)
class RequestInput:
    """Something of the request a routing part may read (`needs`), not an engine column."""

    name: str
    producer: str
    unit: str


_SIGNALS = (
    Signal("load", "router: Telemetry.num_running + num_waiting + in flight", "requests", PER_REPORT_AND_DECISION,
           doc="the router's best count of requests on the engine (a snapshot attribute)"),
    Signal("kv_usage", "Telemetry.kv_usage", "fraction of KV blocks", PER_TELEMETRY, view="kv_usage"),
    Signal("alive", "router: live, and a hello or telemetry within fresh_load_s", "bool", PER_DECISION, dtype=np.bool_,
           fill=1.0, doc="the engine may receive requests (a snapshot attribute)"),
    Signal("running", "Telemetry.num_running", "requests", PER_TELEMETRY, view="num_running"),
    Signal("waiting", "router: Telemetry.num_waiting + in flight", "requests", PER_REPORT_AND_DECISION,
           view="num_waiting", doc="decisions since the last report count as waiting, as vLLM's client counts them"),
    Signal("outstanding", "router: = load", "requests", PER_DECISION,
           doc="unfinished requests (exact in the simulator)"),
    Signal("remaining_prefill", "Telemetry.remaining_prefill_tokens", "tokens", PER_TELEMETRY,
           view="remaining_prefill"),
    Signal("waiting_prefill", "Telemetry.waiting_prefill_tokens", "tokens", PER_TELEMETRY, view="waiting_prefill"),
    Signal("step_time", "Telemetry.step_time_ema", "seconds", PER_TELEMETRY, view="step_time"),
    Signal("expert_pressure", "Telemetry.expert_pressure", "ratio, floored at 1", PER_TELEMETRY,
           view="expert_pressure", fill=1.0),
    Signal("inflight", "router ledger", "requests", PER_DECISION, doc="decisions since the engine's last report"),
    Signal("inflight_tokens", "router ledger", "prompt tokens", PER_DECISION, doc="their prompt tokens"),
    Signal("pending_prefill", "exact ledger: sent, no first token yet (solver.routing.exact_ledger)", "prompt tokens",
           PER_DECISION, doc="prefill the engine still owes, from the dispatcher's own sends and first tokens"),
    Signal("pending", "exact ledger: sent, no first token yet", "requests", PER_DECISION,
           doc="the requests behind pending_prefill"),
    Signal("decoding", "exact ledger: past the first token, not finished", "requests", PER_DECISION,
           doc="the engine's decode load, from the dispatcher's own first-token and end events"),
    Signal("recent_sends", "router: its decisions, each decaying as exp(-age / 20 ms) (exact_ledger.RecentSends)",
           "requests", PER_DECISION, doc="requests just sent to the engine, whether or not they have a first token"),
    Signal("kv_blocks", "Hello.capacity.kv_blocks", "KV blocks", "per hello", view="kv_blocks",
           doc="the engine's KV cache size in blocks (Dynamo's decode blocks are kv_usage of it)"),
    Signal("indexed_blocks", "router: prefix index (solver.routing.prefix)", "blocks", PER_DECISION,
           doc="blocks the prefix index holds for the engine (SGLang's tree size: a small one has room to cache)"),
    Signal(
        "migrating",
        producer="Telemetry.migrating",
        unit="0 or 1",
        staleness=PER_TELEMETRY,
        view="migrating",
        doc="the engine's EP group is moving experts: its steps are slower until it is done",
    ),
)  # fmt: skip

#: Every engine signal by name.
SIGNALS: Mapping[str, Signal] = MappingProxyType({s.name: s for s in _SIGNALS})

#: What a routing part may read of the request (anything else in `needs` is a signal).
REQUEST_INPUTS: Mapping[str, RequestInput] = MappingProxyType(
    {
        r.name: r
        for r in (
            RequestInput("similarity", "RouteDecodeRequest.signature against the artifact", "cosine per centroid"),
            RequestInput("label", "RouteDecodeRequest.label", "domain label"),
            RequestInput("prompt_tokens", "RouteDecodeRequest/RouteDpRequest.prompt_tokens", "tokens"),
            RequestInput(
                "cached_tokens",
                "the prefix index (solver.routing.prefix): the request's block keys against each engine's blocks",
                "prompt tokens per engine, in snapshot order",
            ),
            RequestInput(
                "expert_affinity",
                "solver.routing.affinity: the request's predicted expert signature (the signature cache, by its "
                "prefix block keys) against each engine's recent expert traffic",
                "centered cosine per engine in [-1, 1], in snapshot order",
            ),
        )
    }
)


class UnknownSignal(ValueError):
    """A routing part (or a user of the registry) names a signal the registry does not have."""


def need(*names: str) -> frozenset[str]:
    """The names as a part's `needs`, each checked against the registry (signals and request inputs).

    Called where a part is defined (`needs: frozenset[str] = need("kv_usage")`), so a misspelt name fails at
    import, naming the closest known one."""
    for name in names:
        if name not in SIGNALS and name not in REQUEST_INPUTS:
            known = [*SIGNALS, *REQUEST_INPUTS]
            close = difflib.get_close_matches(name, known, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise UnknownSignal(
                f"unknown signal {name!r}{hint}: add it to shared/signals.py (known: {', '.join(known)})"
            )
    return frozenset(names)


def telemetry_view_columns() -> dict[str, tuple[type, float]]:
    """The telemetry view's stored column of every signal that has one: its dtype and fill."""
    return {s.view: (s.dtype, s.fill) for s in _SIGNALS if s.view is not None}


def _check() -> None:
    """The registry is consistent with the message it reads: checked at import."""
    views = [s.view for s in _SIGNALS if s.view is not None]
    if len(set(views)) != len(views) or len(SIGNALS) != len(_SIGNALS) or set(SIGNALS) & set(REQUEST_INPUTS):
        raise AssertionError("shared/signals.py names a signal, view column or request input twice")
    for s in _SIGNALS:
        if s.field is not None and s.field not in Telemetry.model_fields:
            raise AssertionError(f"signal {s.name!r}: Telemetry has no field {s.field!r}")


_check()
