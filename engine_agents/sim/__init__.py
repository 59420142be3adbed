"""Simulated MoE engines: physics, continuous batching, fleet simulation, and a live fleet on the bus."""
