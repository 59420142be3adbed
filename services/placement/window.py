"""The decayed expert-load window and its drift: moved to `solver.placement.window` (the simulated placement
loop plans from the same state); re-exported here for the service's modules and tests."""

from switchyard.solver.placement.window import DecayedLoad, drift

__all__ = ["DecayedLoad", "drift"]
