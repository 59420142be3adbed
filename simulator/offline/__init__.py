"""The offline discrete-event harness: xPyD and DP fleets, scenarios, runs, metrics, report (see `simulator`)."""
