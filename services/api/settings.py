"""API service settings, from `SWITCHYARD_API_*` environment variables."""

from __future__ import annotations

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict


class ApiSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SWITCHYARD_API_", env_file=".env", extra="ignore")

    host: str = "127.0.0.1"
    port: int = Field(default=8080, ge=0, le=65535)
    #: Bearer token for writes (trigger a calibration, re-apply a placement). Unset: every write is refused.
    token: SecretStr | None = None
