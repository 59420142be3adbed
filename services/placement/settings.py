"""Placement service settings, from `SWITCHYARD_PLACEMENT_*` environment variables."""

from __future__ import annotations

import socket
import uuid
from typing import Annotated

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from switchyard.shared.placement_terms import (
    BUILTIN_TERMS,
    DEFAULT_DRIFT_THRESHOLD,
    DEFAULT_GAIN_THRESHOLD,
    DEFAULT_HALF_LIFE_S,
    DEFAULT_MIGRATION_COST,
    DEFAULT_MIN_INTERVAL_S,
    DEFAULT_PAYOFF_MARGIN,
    DEFAULT_PERIOD_S,
    DEFAULT_RANKS_PER_NODE,
    DEFAULT_REDUNDANT_SLOTS,
    DEFAULT_STEP_S,
    DEFAULT_WEIGHTS,
    MAX_TERMS,
    TERM_NAME_PATTERN,
)

TermName = Annotated[str, Field(pattern=TERM_NAME_PATTERN)]
Weight = Annotated[float, Field(ge=0, allow_inf_nan=False)]


class PlacementSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SWITCHYARD_PLACEMENT_", env_file=".env", extra="ignore")

    #: Run the greedy for every engine group at least this often.
    period_s: float = Field(default=DEFAULT_PERIOD_S, gt=0)
    #: Run early when the group's expert-load distribution has moved this far (total variation, 0..1, mean
    #: over layers) from the one the last run saw.
    drift_threshold: float = Field(default=DEFAULT_DRIFT_THRESHOLD, gt=0, le=1)
    #: Never run one group more often than this, whatever the drift.
    min_interval_s: float = Field(default=DEFAULT_MIN_INTERVAL_S, ge=0)
    #: Half-life of the decayed load window: a window this old weighs half as much as a fresh one.
    half_life_s: float = Field(default=DEFAULT_HALF_LIFE_S, gt=0)
    #: On start, rebuild the decayed window from this much of the expert-load stream.
    warmup_s: float = Field(default=1800.0, ge=0)
    #: The first screen: a plan goes on to the payoff rule (`payoff_margin`: predicted step time saved against the
    #: migration's) only when (load+comm improvement − migration cost) exceeds this fraction of the objective.
    gain_threshold: float = Field(default=DEFAULT_GAIN_THRESHOLD, ge=0)
    #: The step-time rule (issue 40): publish only when the step time the new layout is predicted to save over the
    #: horizon exceeds its migration's predicted cost by this fraction of that cost.
    payoff_margin: float = Field(default=DEFAULT_PAYOFF_MARGIN, ge=0)
    #: The horizon a layout is credited for, in seconds (None: `period_s`, the time until the next plan).
    horizon_s: float | None = Field(default=None, gt=0)
    #: Step time assumed when the group's engines report none in telemetry (`step_time_ema`), in seconds.
    step_s: float = Field(default=DEFAULT_STEP_S, gt=0)
    #: The simulator's model preset the rule prices with when the announced model is not one it knows.
    step_model: str = "deepseek-v2-lite"
    #: The GPU the rule prices expert reads and compute on (a `simulator.core.physics.GPUS` name).
    gpu: str = "H100"
    #: GPUs per NVLink domain: a group's GPU g sits on node g // ranks_per_node (links priced apart).
    ranks_per_node: int = Field(default=DEFAULT_RANKS_PER_NODE, ge=1)
    #: Most bytes one plan may have any GPU receive (None: the whole target at once); the rest follows in the
    #: next plans, each as soon as `min_interval_s` allows, the hottest experts first.
    stage_bytes: float | None = Field(default=None, gt=0)
    #: Migration cost of changing whether one GPU hosts one expert, in the solver's canonical units
    #: (mean GPU load = 1 per layer); charged at both ends of a move. Same default as `switchyard calibrate`.
    migration_cost: float = Field(default=DEFAULT_MIGRATION_COST, ge=0)
    #: Extra expert copies per layer (EPLB-style replicas of hot experts); 0: one copy of each expert.
    redundant_slots: int = Field(default=DEFAULT_REDUNDANT_SLOTS, ge=0)
    #: Objective weights (the MINLP's) by term name, as JSON (`SWITCHYARD_PLACEMENT_WEIGHTS='{"load": 40}'`);
    #: a term not named weighs its default (`shared.placement_terms`). The greedy's multipliers (α, β, γ) come
    #: from the latest calibration.
    weights: dict[TermName, Weight] = Field(default_factory=dict, max_length=MAX_TERMS)
    #: The built-in terms' weights one by one (`SWITCHYARD_PLACEMENT_WEIGHT_LOAD`, ...); set, they win over `weights`.
    weight_load: float | None = Field(default=None, ge=0, allow_inf_nan=False)
    weight_comm: float | None = Field(default=None, ge=0, allow_inf_nan=False)
    weight_mig: float | None = Field(default=None, ge=0, allow_inf_nan=False)
    #: Delete rows of the `engines` table not seen for this long (checked hourly); 0 keeps them forever.
    engine_retention_s: float = Field(default=7 * 86400.0, ge=0)
    #: Drop a group's decayed window once no live engine of the group has said hello for this long (a window
    #: for an invented group must not be kept forever; a restart's stream replay brings back only live ones).
    orphan_window_s: float = Field(default=30.0, ge=0)
    #: Do not plan a group while its last published plan is unresolved: while its migration is unfinished (however
    #: long: a standby migration replica takes over a dead owner's), or, for a plan no migration replica has
    #: recorded yet, until it is older than this.
    inflight_timeout_s: float = Field(default=600.0, gt=0)
    #: Store the slot layout of rejected plans too (each is L x G x slots rows).
    store_rejected_layouts: bool = False
    #: Longest one API-triggered calibration may take: the per-layer MINLP time limit shrinks to fit it.
    calibration_budget_s: float = Field(default=300.0, gt=0)
    #: Delete `rejected` decisions older than this (one is written per group per period); 0 keeps them forever.
    #: Published, applied, failed and superseded placements are history and are never deleted.
    rejected_retention_s: float = Field(default=7 * 86400.0, ge=0)
    #: Refuse expert-load windows that end more than this far in the future (a skewed clock would otherwise
    #: freeze the decayed window: everything after it would count as late and fade).
    max_clock_skew_s: float = Field(default=60.0, gt=0)
    #: How long to wait for a group's coordinator to report its live layout before planning from the database.
    layout_timeout_s: float = Field(default=2.0, gt=0)
    #: How often the service checks its triggers.
    tick_s: float = Field(default=1.0, gt=0)
    #: Serve this service's Prometheus metrics on this port (None: off; the API serves its own at /metrics).
    metrics_port: int | None = Field(default=None, ge=0, le=65535)
    metrics_host: str = "127.0.0.1"
    #: One replica acts for a group at a time: it holds the group's lease (`<prefix>-leases`), renewed every
    #: tick (at most a third of this); a replica that stops renewing loses the group to another after this long.
    lease_ttl_s: float = Field(default=10.0, ge=1.0, le=300.0)
    #: This replica's name as a lease owner.
    replica_id: str = Field(default_factory=lambda: f"{socket.gethostname()}-{uuid.uuid4().hex[:8]}")

    @model_validator(mode="after")
    def _ticks_renew_leases_in_time(self) -> PlacementSettings:
        if self.tick_s > self.lease_ttl_s / 3:
            raise ValueError(
                f"tick_s ({self.tick_s:g} s) must be at most a third of lease_ttl_s ({self.lease_ttl_s:g} s): "
                "each tick renews the held group leases"
            )
        return self

    def objective_weights(self) -> dict[str, float]:
        """Every configured objective weight by term: the defaults, then `weights`, then `weight_<term>`."""
        merged = {**DEFAULT_WEIGHTS, **self.weights}
        for term in BUILTIN_TERMS:
            value = getattr(self, f"weight_{term}")
            if value is not None:
                merged[term] = value
        return merged
