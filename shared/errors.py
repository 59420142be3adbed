"""Typed errors for everything that crosses a process boundary.

A service that receives a bad message must be able to say *which* field was wrong and why, count it by
a stable code, and carry on. Every decoding failure is therefore a `WireError` with a `code` (stable,
used as a metric label), a `field` (dotted path into the message, or "" for the whole payload) and a
human-readable `reason`.
"""

from __future__ import annotations


class WireError(ValueError):
    """A payload that cannot be accepted. Subclasses only refine `code`."""

    code = "invalid"

    def __init__(self, field: str, reason: str) -> None:
        self.field = field
        self.reason = reason
        where = f"field '{field}'" if field else "payload"
        super().__init__(f"{self.code}: {where}: {reason}")

    def to_dict(self) -> dict[str, str]:
        return {"code": self.code, "field": self.field, "message": self.reason}


class PayloadTooLarge(WireError):
    code = "too_large"


class NotMsgpack(WireError):
    code = "not_msgpack"


class UnknownSchemaVersion(WireError):
    code = "unknown_version"


class SchemaMismatch(WireError):
    """A field has the wrong type, is missing, or is out of range."""

    code = "schema"


class ArrayMismatch(WireError):
    """An array's dtype, shape or byte size does not match its declaration or the schema."""

    code = "array"


class Impersonation(WireError):
    """A message names another engine than the subject it was published on (`sy.engine.<id>.`): with
    per-engine bus permissions the subject is the proof of who sent it, the payload's claim is not."""

    code = "engine_id_mismatch"


class ReplicaImpersonation(WireError):
    """Decisions naming another replica than the subject they were published on (`sy.route.decided.<kind>.<id>`):
    the permissions let a gateway publish only under its own id, so the subject, not the payload, says whose."""

    code = "replica_id_mismatch"


class Relayed(WireError):
    """A message published on another subject than the subscription's: a JetStream consumer's delivery of
    stored bytes to a subject its creator chose (see `shared.bus`)."""

    code = "relayed"


class ConfigError(ValueError):
    """A setting or URL the user gave cannot work (unknown scheme, missing server): said in one line."""


class RemoteError(RuntimeError):
    """The peer answered a request with an error reply."""

    def __init__(self, code: str, field: str, message: str) -> None:
        self.code = code
        self.field = field
        self.message = message
        super().__init__(f"remote error {code}" + (f" in '{field}'" if field else "") + f": {message}")
