"""Simulated MoE engines as agents on the bus (`live`): engines that speak the bus and OpenAI HTTP in scaled real
time, their load generators and processes. They run the discrete-event simulator's engine model
(`simulator.core`) and its scenarios (`simulator.offline.scenario`); the simulator itself is its own top-level
package, `switchyard.simulator`.
"""
