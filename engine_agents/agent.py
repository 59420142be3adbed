"""Moved to `engine_agents.core.agent`; this name stays so that existing imports keep working."""

from switchyard.engine_agents.core.agent import EngineAgent, TelemetrySource

__all__ = ["EngineAgent", "TelemetrySource"]
