"""Engine agents: `vllm/` runs inside vLLM engine processes; `sim/` simulates MoE engines speaking the same protocol."""
