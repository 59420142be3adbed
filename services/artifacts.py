"""Routing-artifact persistence: a file, the `routing_artifacts` history table, and the JetStream KV bucket.

The file and the KV value are the artifact's exact wire encoding (`shared.codec.encode`, msgpack), so a
router reads any of them with the same validated `decode`. Reads verify the content hash, so a truncated
or edited artifact is refused instead of routing traffic.

Versions: a newly published artifact gets 1 + the highest version known to any destination given (the
database table, the KV bucket's current value, an artifact already in the output file). The table's
unique version column settles a race between two publishers: the loser retries with the next version.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import os
import tempfile
from pathlib import Path
from typing import Any

from nats.js.errors import KeyNotFoundError, NoKeysError
from nats.js.kv import KeyValue

from switchyard.shared.artifact_hash import artifact_content_hash
from switchyard.shared.bus import Bus
from switchyard.shared.codec import decode, encode
from switchyard.shared.errors import WireError
from switchyard.shared.schemas import RoutingArtifact
from switchyard.shared.settings import SwitchyardSettings

__all__ = [
    "MAX_ARTIFACT_BYTES",
    "ArtifactError",
    "artifact_signature",
    "get_artifact_kv",
    "last_valid_artifact",
    "latest_db_version",
    "load_artifact",
    "publish_artifact",
    "publish_to",
    "put_artifact_kv",
    "read_artifact_file",
    "sign_artifact",
    "store_artifact_db",
    "write_artifact_file",
]

#: Files may be larger than a bus payload (K = 64 decoders × 48 × 128 float32 centroids is 1.5 MiB).
MAX_ARTIFACT_BYTES = 64 * 1024 * 1024


class ArtifactError(ValueError):
    """An artifact that cannot be read or trusted (undecodable, wrong hash); `code` says which, for counters."""

    def __init__(self, message: str, code: str = "invalid") -> None:
        super().__init__(message)
        self.code = code


def artifact_signature(artifact: RoutingArtifact, key: bytes) -> str:
    """HMAC-SHA256 over the version and the content hash (which covers every field a router uses)."""
    message = f"switchyard-routing-artifact:{artifact.version}:{artifact.content_hash}".encode()
    return hmac.new(key, message, hashlib.sha256).hexdigest()


def sign_artifact(artifact: RoutingArtifact, key: bytes | None) -> RoutingArtifact:
    """The artifact with its signature (unchanged when there is no key)."""
    if key is None:
        return artifact
    return artifact.model_copy(update={"signature": artifact_signature(artifact, key)})


def load_artifact(
    data: bytes, max_bytes: int = MAX_ARTIFACT_BYTES, where: str = "artifact", key: bytes | None = None
) -> RoutingArtifact:
    """Decode and verify an artifact's wire encoding; with `key`, also its signature (unsigned is refused).

    The content hash is a checksum anyone can recompute; only the signature says the fit job made it.
    """
    try:
        artifact = decode(data, RoutingArtifact, max_bytes)
    except WireError as exc:
        raise ArtifactError(f"{where}: {exc}", exc.code) from None
    if artifact_content_hash(artifact) != artifact.content_hash:
        raise ArtifactError(f"{where}: content does not match its hash {artifact.content_hash[:16]}…", "hash")
    if key is not None:
        if artifact.signature is None:
            raise ArtifactError(f"{where}: unsigned, and this process requires signed artifacts", "unsigned")
        if not hmac.compare_digest(artifact.signature, artifact_signature(artifact, key)):
            raise ArtifactError(f"{where}: signature does not match (not signed with this key)", "signature")
    return artifact


async def last_valid_artifact(
    kv: KeyValue, key_name: str, max_bytes: int, key: bytes | None = None
) -> tuple[RoutingArtifact, int] | None:
    """The newest revision of the KV key that is a valid (and, with `key`, signed) artifact, and its revision.

    One garbage write must not disable ELDR for every router started after it: they fall back to the last
    good revision the bucket still keeps (its history).
    """
    try:
        entries = await kv.history(key_name)
    except NoKeysError:
        return None
    for entry in reversed(entries):
        if entry.value is None or entry.operation in ("DEL", "PURGE"):
            return None  # removed on purpose: nothing older is current
        try:
            return load_artifact(entry.value, max_bytes, "KV artifact", key), entry.revision
        except ArtifactError:
            continue
    return None


def write_artifact_file(artifact: RoutingArtifact, path: str | Path) -> None:
    """Write atomically (temp file + rename), so a reader never sees half an artifact."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(encode(artifact))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_artifact_file(path: str | Path) -> RoutingArtifact:
    path = Path(path)
    try:
        size = path.stat().st_size
    except OSError as exc:
        raise ArtifactError(f"{path}: {exc.strerror or exc}") from None
    if size > MAX_ARTIFACT_BYTES:
        raise ArtifactError(f"{path}: {size} bytes exceed {MAX_ARTIFACT_BYTES}")
    return load_artifact(path.read_bytes(), where=str(path))


def _file_version(path: Path) -> int:
    """Version of the artifact already at `path`; 0 if none or unreadable (it is simply replaced)."""
    if not path.is_file():
        return 0
    try:
        return read_artifact_file(path).version
    except ArtifactError:
        return 0


async def latest_db_version(database_url: str) -> int:
    """Highest artifact version in the table (0 if none). The schema must exist (`shared.db.upgrade`)."""
    # The database layer (SQLAlchemy) is imported by the functions that write history, not by the router,
    # which only reads artifacts from the bus: it restarts faster without it (docs/reliability.md).
    from sqlalchemy import func, select

    from switchyard.shared.db import RoutingArtifactRow, create_async_db

    engine, sessions = create_async_db(database_url)
    try:
        async with sessions() as session:
            return int(await session.scalar(select(func.coalesce(func.max(RoutingArtifactRow.version), 0))))
    finally:
        await engine.dispose()


async def store_artifact_db(database_url: str, artifact: RoutingArtifact, report: dict[str, Any] | None = None) -> None:
    """Append the artifact to the history table; raises IntegrityError if its version is taken."""
    from switchyard.shared.db import RoutingArtifactRow, create_async_db

    engine, sessions = create_async_db(database_url)
    try:
        async with sessions() as session, session.begin():
            session.add(
                RoutingArtifactRow(
                    version=artifact.version,
                    content_hash=artifact.content_hash,
                    representation=artifact.representation,
                    tau=artifact.tau,
                    rho=artifact.rho,
                    num_decoders=int(artifact.centroids.shape[0]),
                    layer_mask=list(artifact.layer_mask),
                    source="fit",
                    payload=encode(artifact),
                    report=report or {},
                )
            )
    finally:
        await engine.dispose()


async def get_artifact_kv(bus: Bus, key: bytes | None = None) -> RoutingArtifact | None:
    """The current artifact in the KV bucket, or None if none was ever published."""
    kv = await bus.ensure_kv(bus.subjects.router_bucket)
    try:
        entry = await kv.get(bus.subjects.artifact_key)
    except KeyNotFoundError:
        return None
    if entry.value is None:
        return None
    return load_artifact(entry.value, bus.max_payload, where=f"KV {bus.subjects.router_bucket}", key=key)


async def put_artifact_kv(bus: Bus, artifact: RoutingArtifact) -> int:
    """Make the artifact current; returns the KV revision."""
    kv = await bus.ensure_kv(bus.subjects.router_bucket)
    return await kv.put(bus.subjects.artifact_key, encode(artifact))


async def publish_artifact(
    artifact: RoutingArtifact,
    report: dict[str, Any] | None = None,
    *,
    out: str | Path | None = None,
    database_url: str | None = None,
    bus: Bus | None = None,
    attempts: int = 5,
    key: bytes | None = None,
) -> RoutingArtifact:
    """Give the artifact its version (and, with `key`, its signature) and write it to every destination given;
    returns the versioned copy.

    The database is written first (its unique version settles races), then the KV bucket, then the file.
    """
    from sqlalchemy.exc import IntegrityError

    known = [0]
    if out is not None:
        known.append(await asyncio.to_thread(_file_version, Path(out)))
    if bus is not None:
        try:
            current = await get_artifact_kv(bus)
        except ArtifactError:  # a garbage current value: the history still knows the versions
            kv = await bus.ensure_kv(bus.subjects.router_bucket)
            found = await last_valid_artifact(kv, bus.subjects.artifact_key, bus.max_payload)
            current = found[0] if found else None
        known.append(current.version if current else 0)
    if database_url is not None:
        known.append(await latest_db_version(database_url))
    version = max(known) + 1
    for attempt in range(attempts):
        versioned = sign_artifact(artifact.model_copy(update={"version": version}), key)
        if database_url is None:
            break
        try:
            await store_artifact_db(database_url, versioned, report)
            break
        except IntegrityError:
            if attempt == attempts - 1:
                raise
            version = max(version, await latest_db_version(database_url)) + 1
    if bus is not None:
        await put_artifact_kv(bus, versioned)
    if out is not None:
        await asyncio.to_thread(write_artifact_file, versioned, out)
    return versioned


async def publish_to(
    artifact: RoutingArtifact,
    report: dict[str, Any] | None,
    settings: SwitchyardSettings,
    *,
    out: str | Path | None = None,
    database_url: str | None = None,
    nats_servers: list[str] | None = None,
) -> RoutingArtifact:
    """`publish_artifact` with connections made from settings: the schema is brought to head and the bus
    connected only for the destinations asked for."""
    if database_url is not None:
        from switchyard.shared.db import upgrade

        await asyncio.to_thread(upgrade, database_url)
    bus = await Bus.connect(settings, name="switchyard-fit", servers=nats_servers, role="fit") if nats_servers else None
    try:
        return await publish_artifact(
            artifact, report, out=out, database_url=database_url, bus=bus, key=settings.artifact_key()
        )
    finally:
        if bus is not None:
            await bus.close()
