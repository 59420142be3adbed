"""How much the bus contract's streams and buckets may hold, sized from the contract (settings in `settings.py`).

Why: without limits one engine's credentials stored 3.7 GB of expert-load windows in 30 s (issue 29), and
placement replays that stream after a restart. The rules behind the numbers:

- **Per engine first.** Expert-load subjects are per engine (`<p>.engine.<id>.expert_load`), so
  `max_msgs_per_subject` caps each engine's windows and a flooding engine only rolls out its own old ones;
  with `max_msg_size` that makes one engine's share at most `windows_per_engine × window_bytes`.
- **The stream's bytes are the store's bound** (`max_bytes`, discarding the oldest), set well above one
  engine's share so that an engine at its cap never pushes another engine's windows out; the settings refuse
  a per-engine share that would not fit.
- **Plans never age out.** The placement stream holds work (plans, calibration requests) written only by
  trusted roles; it has no age limit and room for weeks of plans at the highest rate placement publishes, so
  a plan is only ever dropped for being among the oldest of 100,000 (see the settings).
- JetStream reserves each stream's `max_bytes` against the server's file store up front: the server's
  `max_file_store` must hold `store_bound` (what `switchyard nats-config` writes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from nats.js.api import DiscardPolicy, StreamConfig

if TYPE_CHECKING:
    from switchyard.shared.settings import SwitchyardSettings

#: Largest value a lease holds: its owner's replica id (a host name and a suffix).
LEASE_VALUE_BYTES = 1024
#: The stream fields `limits_differ` reconciles (subjects aside).
LIMIT_FIELDS = ("max_bytes", "max_msgs", "max_age", "max_msg_size", "max_msgs_per_subject", "discard")


@dataclass(frozen=True)
class StreamLimits:
    """One stream's limits; 0 means "none" for an age, a per-subject count or a size."""

    max_bytes: int
    max_msgs: int
    max_age_s: float
    max_msg_size: int
    max_msgs_per_subject: int = 0
    discard: DiscardPolicy = DiscardPolicy.OLD

    def config(self) -> dict[str, Any]:
        """The `StreamConfig` fields, in the server's spelling of "none" (-1 for counts and sizes)."""
        return {
            "max_bytes": self.max_bytes or -1,
            "max_msgs": self.max_msgs or -1,
            "max_age": self.max_age_s,
            "max_msg_size": self.max_msg_size or -1,
            "max_msgs_per_subject": self.max_msgs_per_subject or -1,
            "discard": self.discard,
        }


def contract_limits(settings: SwitchyardSettings) -> dict[str, StreamLimits]:
    """Stream name -> its limits, for every stream of `Subjects.streams`."""
    s = settings.subjects
    return {
        s.expert_load_stream: StreamLimits(
            max_bytes=settings.stream_expert_load_max_bytes,
            max_msgs=settings.stream_expert_load_max_msgs,
            max_age_s=settings.stream_expert_load_max_age_s,
            max_msg_size=settings.stream_expert_load_window_bytes,
            max_msgs_per_subject=settings.stream_expert_load_windows_per_engine,
        ),
        s.placement_stream: StreamLimits(
            max_bytes=settings.stream_placement_max_bytes,
            max_msgs=settings.stream_placement_max_msgs,
            max_age_s=settings.stream_placement_max_age_s,
            max_msg_size=settings.max_payload_bytes,  # plans are trusted work: up to what the bus carries
        ),
        s.routing_samples_stream: StreamLimits(
            max_bytes=settings.stream_routing_samples_max_bytes,
            max_msgs=settings.stream_routing_samples_max_msgs,
            max_age_s=settings.stream_routing_samples_max_age_s,
            max_msg_size=settings.stream_routing_samples_sample_bytes,
        ),
    }


def bucket_limits(settings: SwitchyardSettings) -> dict[str, tuple[int, int]]:
    """KV bucket -> (max_bytes, max_value_size). History and TTL stay each caller's (`Bus.ensure_kv`)."""
    s = settings.subjects
    return {
        s.router_bucket: (settings.kv_router_max_bytes, settings.max_payload_bytes),
        s.lease_bucket: (settings.kv_leases_max_bytes, LEASE_VALUE_BYTES),
    }


def store_bound(settings: SwitchyardSettings) -> int:
    """Bytes the contract's streams and buckets can hold at most, all together (one subject prefix)."""
    streams = sum(limits.max_bytes for limits in contract_limits(settings).values())
    return streams + sum(max_bytes for max_bytes, _ in bucket_limits(settings).values())


def file_store_bytes(settings: SwitchyardSettings) -> int:
    """A server's `max_file_store` for one deployment: `store_bound` and a quarter (consumer state, block
    overhead, the routing samples' stream of before the rename), rounded up to a GiB."""
    gib = 1 << 30
    return -(-store_bound(settings) * 5 // 4 // gib) * gib


def _normal(field: str, value: Any) -> Any:
    if field == "discard":
        return value or DiscardPolicy.OLD
    if field == "max_age":
        return float(value or 0)
    return value if value is not None and value > 0 else -1


def limits_differ(current: StreamConfig, wanted: dict[str, Any]) -> bool:
    """Whether `current` (as the server reports it) has other limits than `wanted` (`StreamLimits.config`)."""
    return any(_normal(k, getattr(current, k)) != _normal(k, v) for k, v in wanted.items())
