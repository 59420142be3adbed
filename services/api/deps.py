"""What every route needs: the service state, a database session, the write guard, and cursors."""

from __future__ import annotations

import base64
import binascii
import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Annotated

from fastapi import Depends, HTTPException, Request, status
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from nats.js.kv import KeyValue
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker

from switchyard.services.api.settings import ApiSettings
from switchyard.services.fleet_view import FleetView
from switchyard.shared.bus import Bus
from switchyard.shared.settings import SwitchyardSettings


@dataclass
class ApiState:
    settings: SwitchyardSettings
    config: ApiSettings
    engine: AsyncEngine
    sessions: async_sessionmaker[AsyncSession]
    bus: Bus
    fleet: FleetView
    kv: KeyValue
    ingest: Bus | None = None  # the fleet view's own connection (hellos, telemetry); `bus` carries the rest


def get_state(request: Request) -> ApiState:
    return request.app.state.switchyard


State = Annotated[ApiState, Depends(get_state)]


async def get_session(state: State) -> AsyncIterator[AsyncSession]:
    async with state.sessions() as session:
        yield session


Session = Annotated[AsyncSession, Depends(get_session)]

_CHALLENGE = {"WWW-Authenticate": "Bearer"}
_bearer = HTTPBearer(auto_error=False, description="The value of SWITCHYARD_API_TOKEN.")


def require_token(state: State, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]) -> None:
    """Writes need `Authorization: Bearer <SWITCHYARD_API_TOKEN>`; with no token configured, none is allowed."""
    expected = state.config.token
    if expected is None:
        raise HTTPException(
            status.HTTP_403_FORBIDDEN, "writes are disabled: no API token is configured (set SWITCHYARD_API_TOKEN)"
        )
    if credentials is None:
        raise HTTPException(status.HTTP_401_UNAUTHORIZED, "this write needs a bearer token", headers=_CHALLENGE)
    if not secrets.compare_digest(credentials.credentials.encode(), expected.get_secret_value().encode()):
        raise HTTPException(
            status.HTTP_401_UNAUTHORIZED, "invalid bearer token", headers={"WWW-Authenticate": "Bearer"}
        )


Writer = Depends(require_token)
_CURSOR_PREFIX = "id:"


def encode_cursor(last_id: int) -> str:
    """Opaque to clients: the id of the last row of a page (listings are ordered by id, newest first)."""
    return base64.urlsafe_b64encode(f"{_CURSOR_PREFIX}{last_id}".encode()).decode().rstrip("=")


def decode_cursor(cursor: str | None) -> int | None:
    if cursor is None:
        return None
    try:
        text = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode()
        if text.startswith(_CURSOR_PREFIX) and text[len(_CURSOR_PREFIX) :].isdigit():
            value = int(text[len(_CURSOR_PREFIX) :])
            if value < 2**63:
                return value
    except (binascii.Error, UnicodeDecodeError, ValueError):
        pass
    raise HTTPException(status.HTTP_400_BAD_REQUEST, "invalid cursor: pass next_cursor from a previous page unchanged")


def as_utc(value: datetime | None, name: str) -> datetime | None:
    """Query datetimes in UTC; one without a zone is taken as UTC."""
    if value is None:
        return None
    try:
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)
    except (OverflowError, ValueError):
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_ENTITY, f"{name}: {value} is out of range") from None
