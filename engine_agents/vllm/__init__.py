"""The agent that runs inside vLLM engine processes (needs the `vllm` extra)."""
