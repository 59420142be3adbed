"""Migration service settings, from `SWITCHYARD_MIGRATION_*` environment variables."""

from __future__ import annotations

import socket
import uuid

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class MigrationSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SWITCHYARD_MIGRATION_", env_file=".env", extra="ignore")

    #: How long to wait for an engine to acknowledge one step (one layer; ~15 ms simulated, 0.36 s more the first time).
    step_timeout_s: float = Field(default=30.0, gt=0)
    #: Sends of one step before it is declared in doubt and the migration fails (every resend is idempotent).
    max_attempts: int = Field(default=5, ge=1)
    #: Delay before the first resend; doubled per attempt up to 10 s.
    retry_backoff_s: float = Field(default=0.5, ge=0)
    #: How long to wait for the coordinator to report the group's live layout before planning from the database.
    layout_timeout_s: float = Field(default=2.0, gt=0)
    #: Times the service takes up one migration (each crash or unexpected error counts) before marking it failed.
    max_runs: int = Field(default=5, ge=1)
    #: How long a new migration waits for a live engine of its group to say hello before it fails.
    engine_wait_s: float = Field(default=15.0, gt=0)
    #: A plan left `published` with no migration this long was skipped on its way (a consumer rewritten, a
    #: message lost): it is taken up from the database. Recording a delivered plan takes milliseconds; a plan
    #: still in the consumer's backlog and taken up early is recorded once all the same.
    skipped_plan_s: float = Field(default=60.0, gt=0)
    #: How often to look for skipped plans and check the plans consumer's settings (`services.migration.reconcile`).
    reconcile_s: float = Field(default=10.0, gt=0)
    #: Serve this service's Prometheus metrics on this port (None: off; the API serves its own at /metrics).
    metrics_port: int | None = Field(default=None, ge=0, le=65535)
    metrics_host: str = "127.0.0.1"
    #: Longest wait before a group's worker tries again after an unexpected error (a database outage): the
    #: migrations resume this soon after it ends (it was 30 s).
    retry_max_s: float = Field(default=5.0, gt=0, le=60)
    #: One replica acts for a group at a time: it holds the group's lease (`<prefix>-leases`), renewed every
    #: third of this; a replica that stops renewing loses the group to another after this long.
    lease_ttl_s: float = Field(default=10.0, ge=1.0, le=300.0)
    #: How often every replica looks for groups with an unfinished migration and no lease holder (an owner that
    #: died mid-migration) and takes them over (None: a third of `lease_ttl_s`); the takeover comes at most
    #: `lease_ttl_s` + this after the owner's death.
    takeover_scan_s: float | None = Field(default=None, gt=0, le=300.0)
    #: This replica's name as a lease owner.
    replica_id: str = Field(default_factory=lambda: f"{socket.gethostname()}-{uuid.uuid4().hex[:8]}")
