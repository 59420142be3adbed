"""What the placement service knows of a group's physics, for the step-time publish rule (`solver.placement.payoff`).

The rule needs a step-time model (`StepCost`) and a migration price (`MigrationPrice`) for the group's model on
its GPUs. Both are built from the DP+EP simulator's presets (`simulator.core.physics`), so the service predicts
with the constants the simulator runs with: the model its engines announced when the simulator knows it (by the
last part of the name, lower case: `deepseek-ai/DeepSeek-V2-Lite` is `deepseek-v2-lite`), else the configured
`step_model`, with the announced top-k. The step time is the mean `step_time_ema` the group's live engines
report in telemetry, else the configured `step_s`; the requests running and waiting are their telemetry's
`num_running` and `num_waiting`, summed (the queue factor, `payoff.StepContext.queue_factor`).
"""

from __future__ import annotations

from switchyard.services.fleet_view import EngineState
from switchyard.services.placement.settings import PlacementSettings
from switchyard.simulator.core.physics import MODELS, CostModel, ModelSpec, get_gpu, get_model
from switchyard.solver.placement.payoff import MigrationPrice, StepContext
from switchyard.solver.placement.step_time import StepCost

__all__ = ["model_spec", "step_context"]


def model_spec(name: str, config: PlacementSettings) -> ModelSpec:
    """The simulator's preset for an announced model name, else the configured `step_model`."""
    return MODELS.get(name.rsplit("/", 1)[-1].lower()) or get_model(config.step_model)


def step_context(
    config: PlacementSettings, engines: list[EngineState], span_s: float, first: bool, persistence: float = 1.0
) -> StepContext | None:
    """The rule's context for a group of `engines` whose window spans `span_s` decayed seconds and has shown
    `persistence` (`DecayedLoad.persistence`) (None: no hello names the model yet, or the window is empty)."""
    hello = next((e.hello for e in engines if e.hello is not None), None)
    if hello is None or span_s <= 0:
        return None
    spec = model_spec(hello.model.name, config)
    cost = CostModel(spec, get_gpu(config.gpu))
    terms = StepCost(
        expert_read_s=cost.b,
        pair_s=cost.expert_pair_flops_s,
        token_bytes=spec.hidden * 3.0,  # FP8 dispatch + BF16 combine per hidden element (DeepEP)
        top_k=hello.model.top_k,
        ranks_per_node=config.ranks_per_node,
    )
    price = MigrationPrice(expert_bytes=spec.expert_bytes, ranks_per_node=config.ranks_per_node)
    reported = [e.telemetry.step_time_ema for e in engines if e.telemetry is not None and e.telemetry.step_time_ema > 0]
    step_s = sum(reported) / len(reported) if reported else config.step_s
    horizon = config.horizon_s if config.horizon_s is not None else config.period_s
    running = sum(e.telemetry.num_running for e in engines if e.telemetry is not None)
    waiting = sum(e.telemetry.num_waiting for e in engines if e.telemetry is not None)
    return StepContext(
        terms, price, step_s, horizon, span_s, first, config.payoff_margin, persistence, running, waiting
    )
