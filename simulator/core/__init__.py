"""The simulated engine model shared by the offline harness and the live engines (see `simulator`)."""
