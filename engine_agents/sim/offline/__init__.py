"""The offline discrete-event harness: xPyD and DP fleets, scenarios, runs, metrics, report (`engine_agents.sim`)."""
