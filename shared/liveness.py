"""When an engine is live: one rule for the router, the gateway and the fleet view (API, placement, migration).

An engine is **live** until `min(misses × interval, max_silence_s)` after its last hello (with its hello
interval) or after its last telemetry (with its telemetry interval), whichever is later:

    live_until = max(last_hello     + min(misses × hello_interval_s,     max_silence_s),
                     last_telemetry + min(misses × telemetry_interval_s, max_silence_s))

and live at `now` while `now <= live_until`. The intervals are the sender's word (its latest hello's); `misses`
and the cap `max_silence_s` are the operator's, so a sender that announces a long interval cannot keep itself
live for longer than the cap after it died (docs/security.md). A signal never received counts as `-inf`; an
engine not yet heard from with a hello is judged on the schema's default intervals.

The router asks one thing more of an engine it routes to: *fresh load data*, a hello or telemetry within its own
`SWITCHYARD_ROUTER_STALE_AFTER_S` (1 s), because it weighs engines by the load they report. That is not
liveness: an engine live by this rule but without fresh load data is not dead, only not routable by load. So
the router never routes to an engine the gateway or the fleet view counts dead, and every service counts the same
engines dead at the same instant, given the same hellos and telemetry (`tests/test_liveness.py`).

The rule is pure (no clock, no I/O): each service stamps arrivals with its own clock and asks `live_until`
(scalar, per message) or `live_until_columns` (numpy, per fleet).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from pydantic import AliasChoices, Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from switchyard.shared.schemas import Hello

#: The intervals an engine is judged on before its first hello (the hello schema's defaults).
DEFAULT_HELLO_INTERVAL_S: float = Hello.model_fields["hello_interval_s"].default
DEFAULT_TELEMETRY_INTERVAL_S: float = Hello.model_fields["telemetry_interval_s"].default
#: The rule's defaults: three missed intervals, and never more than 15 s of silence.
DEFAULT_MISSES = 3.0
DEFAULT_MAX_SILENCE_S = 15.0


@dataclass(frozen=True)
class Liveness:
    """The rule with its two parameters (see the module docstring)."""

    misses: float = DEFAULT_MISSES
    max_silence_s: float = DEFAULT_MAX_SILENCE_S

    def __post_init__(self) -> None:
        if not (self.misses > 0 and self.max_silence_s > 0):
            raise ValueError(f"liveness needs misses > 0 and max_silence_s > 0: {self.misses}, {self.max_silence_s}")

    def window(self, interval_s: float) -> float:
        """How long one signal sent every `interval_s` keeps an engine live."""
        return min(self.misses * interval_s, self.max_silence_s)

    def live_until(
        self,
        last_hello: float | None,
        hello_interval_s: float = DEFAULT_HELLO_INTERVAL_S,
        last_telemetry: float | None = None,
        telemetry_interval_s: float = DEFAULT_TELEMETRY_INTERVAL_S,
    ) -> float:
        """The last instant the engine is live (`-inf` when it was never heard from)."""
        hello = -math.inf if last_hello is None else last_hello + self.window(hello_interval_s)
        telemetry = -math.inf if last_telemetry is None else last_telemetry + self.window(telemetry_interval_s)
        return max(hello, telemetry)

    def live_until_columns(
        self,
        last_hello: np.ndarray,
        hello_interval_s: np.ndarray,
        last_telemetry: np.ndarray,
        telemetry_interval_s: np.ndarray,
    ) -> np.ndarray:
        """`live_until` per row (`-inf` marks a signal never received); the same floats as the scalar form."""
        hello = last_hello + np.minimum(self.misses * hello_interval_s, self.max_silence_s)
        telemetry = last_telemetry + np.minimum(self.misses * telemetry_interval_s, self.max_silence_s)
        return np.maximum(hello, telemetry)

    @staticmethod
    def is_live(live_until: float, now: float) -> bool:
        return now <= live_until


class LivenessSettings(BaseSettings):
    """The rule's parameters (`SWITCHYARD_LIVENESS_*`), read by every service that judges liveness.

    The gateway's older names still work: `SWITCHYARD_GATEWAY_HELLO_MISSES` for `misses` and
    `SWITCHYARD_GATEWAY_STALE_AFTER_S` for `max_silence_s` (the new names win when both are set)."""

    model_config = SettingsConfigDict(env_file=".env", extra="ignore", populate_by_name=True)

    #: An engine leaves after this many of its own intervals without a hello or telemetry ...
    misses: float = Field(
        default=DEFAULT_MISSES,
        gt=0,
        validation_alias=AliasChoices("SWITCHYARD_LIVENESS_MISSES", "SWITCHYARD_GATEWAY_HELLO_MISSES"),
    )
    #: ... and never more than this many seconds after the last one, whatever interval it announced.
    max_silence_s: float = Field(
        default=DEFAULT_MAX_SILENCE_S,
        gt=0,
        validation_alias=AliasChoices("SWITCHYARD_LIVENESS_MAX_SILENCE_S", "SWITCHYARD_GATEWAY_STALE_AFTER_S"),
    )

    def rule(self) -> Liveness:
        return Liveness(self.misses, self.max_silence_s)
