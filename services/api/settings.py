"""API service settings, from `SWITCHYARD_API_*` environment variables."""

from __future__ import annotations

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict


class ApiSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SWITCHYARD_API_", env_file=".env", extra="ignore")

    #: Loopback by default: serving other hosts is a decision (put TLS and the token in front of it).
    host: str = "127.0.0.1"
    port: int = Field(default=8080, ge=0, le=65535)
    #: Bearer token for writes (trigger a calibration, re-apply a placement). Unset: every write is refused.
    token: SecretStr | None = None
    #: Largest request body (413 beyond; the API's bodies are a few hundred bytes).
    max_body_bytes: int = Field(default=1 << 20, ge=1024)
    #: A request's body must arrive within this long (408 beyond): a slow client cannot pin a worker.
    body_timeout_s: float = Field(default=10.0, gt=0)
    #: A connection must send its request headers within this long of opening (and each later request within this
    #: long of its first byte), else it is closed.
    header_timeout_s: float = Field(default=10.0, gt=0)
    #: Open connections at once (idle keep-alive ones included); one more is answered 503 and closed at once.
    max_connections: int = Field(default=256, ge=1)
