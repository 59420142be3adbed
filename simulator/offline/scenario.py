"""A simulation scenario: a real routing trace split into calibration and replay parts, the physics of the
model that produced it, and the per-policy inputs (ELDR artifacts, domain partition).

- The trace's requests are split, stratified by label and deterministically by seed, into a *calibration*
  part (the ELDR fit sees only these) and a *replay* part (the simulated requests replay only these). The
  two never share a request.
- The model preset must have the trace's shape (MoE layers, experts, top-k): the ESFT trace is
  DeepSeek-V2-Lite, so its physics is DeepSeek-V2-Lite's. The one exception is asked for by name
  (`borrow_routing`): another preset's physics on the trace's routed shape (`core.borrowed_routing`).
- ELDR artifacts come from the offline fit (`solver.eldr_fit`), balanced or vanilla K-means, one centroid
  per decoder; each replayed request's similarity to the centroids from `solver.scoring` on its prefill
  counts (its signature), computed once per artifact.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from switchyard.shared.routing_trace import RoutingTrace
from switchyard.shared.streams import stream
from switchyard.shared.trace_files import TraceFormat, load_trace
from switchyard.simulator.core.borrowed_routing import borrow_routing as borrow
from switchyard.simulator.core.borrowed_routing import overhead_scale
from switchyard.simulator.core.experts import ReplayBank
from switchyard.simulator.core.physics import MODELS, MOE_LAYER_OVERHEAD_S, CostModel, ModelSpec, cost_model
from switchyard.simulator.core.workload import RequestTrace, Workload, build_workload
from switchyard.simulator.offline.xpyd import FleetConfig, SimResult, simulate
from switchyard.solver.routing import DecodePolicy, RoutingTables, get_policy
from switchyard.solver.signatures import RequestCounts, request_counts

__all__ = ["Scenario", "match_model", "prepare", "split_calibration"]


def split_calibration(
    labels: np.ndarray | None, num_requests: int, fraction: float, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """(calibration, replay) request indices: `fraction` of each label's requests calibrate, the rest replay.

    Each label keeps at least one request on each side when it has two or more.
    """
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"calibration fraction must lie strictly between 0 and 1, got {fraction}")
    rng = stream(seed, "split")
    groups = np.zeros(num_requests, np.int64) if labels is None else np.asarray(labels)
    calib: list[np.ndarray] = []
    replay: list[np.ndarray] = []
    for g in np.unique(groups):
        members = rng.permutation(np.flatnonzero(groups == g))
        k = round(fraction * len(members))
        k = min(max(k, 1), len(members) - 1) if len(members) >= 2 else 0
        calib.append(members[:k])
        replay.append(members[k:])
    return np.sort(np.concatenate(calib)), np.sort(np.concatenate(replay))


def match_model(trace: RoutingTrace, name: str | None = None, borrow_routing: bool = False) -> ModelSpec:
    """The model preset for a trace: `name` if given (its shape must match), else the one whose shape does.

    `borrow_routing` (with `name`): a preset of another shape runs on the trace's routed shape with its own
    totals (`simulator.core.borrowed_routing`), named ``<model>@<L>x<E>k<k>``; never implied.
    """
    shape = (trace.num_layers, trace.num_experts, trace.top_k)
    if borrow_routing and name is None:
        raise ValueError("borrowing the trace's routing needs a model preset (--model)")
    if name is not None:
        spec = MODELS.get(name.lower())
        if spec is None:
            raise KeyError(f"unknown model {name!r}; presets: {', '.join(MODELS)}")
        if (spec.moe_layers, spec.num_experts, spec.top_k) != shape:
            if borrow_routing:
                return borrow(spec, shape)
            raise ValueError(
                f"model {spec.name} has {spec.moe_layers} MoE layers x {spec.num_experts} experts, top-{spec.top_k}; "
                f"the trace has {shape[0]} x {shape[1]}, top-{shape[2]}: its physics would not match its routing "
                "(--borrow-routing runs it on the trace's routed shape: docs/gimbal-seed.md)"
            )
        return spec
    for spec in MODELS.values():
        if (spec.moe_layers, spec.num_experts, spec.top_k) == shape:
            return spec
    raise ValueError(f"no model preset has the trace's shape {shape}; pass one with --model after adding it")


@dataclass
class Scenario:
    """A trace prepared for simulation (see the module docstring)."""

    trace: RoutingTrace
    counts: RequestCounts
    calib: np.ndarray
    replay: np.ndarray
    bank: ReplayBank  # rows = `replay`, in order
    cost: CostModel
    seed: int
    _artifacts: dict[tuple[str, int], object] = field(default_factory=dict, repr=False)
    _sims: dict[tuple[str, int], np.ndarray] = field(default_factory=dict, repr=False)

    @property
    def model(self) -> ModelSpec:
        return self.cost.model

    def workload(
        self,
        num_requests: int,
        seed: int,
        rate: float | None = None,
        requests: RequestTrace | None = None,
        time_scale: float = 1.0,
        max_tokens: int | None = None,
    ) -> Workload:
        """Requests replaying the replay part (bank rows), arrivals from a request trace or Poisson."""
        rows = np.arange(self.bank.num_requests)
        return build_workload(
            num_requests,
            rows,
            self.bank.prefill_len,
            self.bank.decode_len,
            seed=seed,
            rate=rate,
            requests=requests,
            time_scale=time_scale,
            max_tokens=max_tokens,
        )

    def fleet(self, prefill: int, decode: int, **kw: object) -> FleetConfig:
        return FleetConfig(prefill=prefill, decode=decode, cost=self.cost, **kw)  # type: ignore[arg-type]

    def domain_shares(self, workload: Workload) -> dict[str, float]:
        """Each label's share of the workload's decode tokens: the oracle Domain baseline's partition weights.

        Oracle by design (the seed's Domain uses ground-truth labels): it knows the load each domain brings.
        """
        labels = self.bank.labels[workload.replay]
        if not self.bank.label_names or (labels < 0).all():
            return {}
        work = np.bincount(
            labels[labels >= 0], weights=workload.output[labels >= 0], minlength=len(self.bank.label_names)
        )
        return {name: float(w) for name, w in zip(self.bank.label_names, work, strict=True) if w > 0}

    def policy_inputs(
        self, policy: DecodePolicy, fleet: FleetConfig, workload: Workload
    ) -> tuple[RoutingTables, np.ndarray | None]:
        """Routing tables and per-bank-row centroid similarities for `policy` on `fleet`'s decoders."""
        engine_ids = [f"d{i:03d}" for i in range(fleet.decode)]
        if policy.fit is None:
            shares = self.domain_shares(workload) if "label" in policy.needs else None
            return RoutingTables.build(engine_ids, label_shares=shares), None
        artifact, sims = self.eldr_inputs(policy.fit, fleet.decode)
        tau = policy.tau if policy.tau is not None else float(artifact.tau)  # type: ignore[attr-defined]
        k = sims.shape[1]
        return RoutingTables.build(engine_ids, num_centroids=k, tau=tau), sims

    def eldr_inputs(self, fit: str, decoders: int) -> tuple[object, np.ndarray]:
        """The ELDR artifact fit on the calibration part (`fit`: balanced | vanilla) and the replay part's sims."""
        from switchyard.solver.eldr_fit import FitOptions, fit_routing_artifact
        from switchyard.solver.scoring import SignatureScorer

        key = (fit, decoders)
        if key not in self._artifacts:
            options = FitOptions(balanced=(fit == "balanced"), seed=self.seed)
            artifact, _report = fit_routing_artifact(self.counts.subset(self.calib), decoders, options)
            self._artifacts[key] = artifact
            scorer = SignatureScorer.from_artifact(artifact)
            self._sims[key] = scorer.similarities_batch(self.counts.prefill[self.replay]).astype(np.float64)
        return self._artifacts[key], self._sims[key]

    def run(
        self,
        workload: Workload,
        fleet: FleetConfig,
        policy: str | DecodePolicy,
        seed: int,
        progress: bool = False,
        check: bool = False,
    ) -> SimResult:
        pol = get_policy(policy) if isinstance(policy, str) else policy
        tables, sims = self.policy_inputs(pol, fleet, workload)
        return simulate(workload, self.bank, fleet, pol, tables, sims, seed=seed, progress=progress, check=check)


def prepare(
    trace: RoutingTrace | str | Path,
    fmt: TraceFormat = "auto",
    model: str | None = None,
    gpu: str = "H100",
    gpus: int | None = None,
    calib_fraction: float = 0.5,
    prefill_fraction: float = 0.5,
    seed: int = 0,
    borrow_routing: bool = False,
) -> Scenario:
    """Load (if a path) and split a routing trace; physics from the matching model preset on `gpu`.

    `borrow_routing`: run `model` on the trace's routed shape (`match_model`), its per-layer fixed MoE cost
    scaled so a step pays the model's layers' worth.
    """
    if not isinstance(trace, RoutingTrace):
        trace = load_trace(trace, fmt=fmt, prefill_fraction=prefill_fraction)
    elif trace.phase is None:
        raise ValueError("the trace has no phase: split it first (shared.routing_trace.split_phases)")
    spec = match_model(trace, model, borrow_routing)
    kw = {}
    if spec.name != (model or spec.name).lower():
        kw["moe_overhead_s"] = MOE_LAYER_OVERHEAD_S * overhead_scale(MODELS[model.lower()], spec)  # type: ignore[union-attr]
    counts = request_counts(trace)
    usable = np.flatnonzero((counts.prefill_tokens > 0) & (counts.decode_tokens > 0))
    labels = counts.label[usable] if counts.label is not None else None
    c, r = split_calibration(labels, len(usable), calib_fraction, seed)
    calib, replay = usable[c], usable[r]
    return Scenario(
        trace=trace,
        counts=counts,
        calib=calib,
        replay=replay,
        bank=ReplayBank.from_trace(trace, replay),
        cost=cost_model(spec, gpu, gpus, **kw),
        seed=seed,
    )
