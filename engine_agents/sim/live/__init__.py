"""Live simulated engines on the bus and OpenAI HTTP, their load generators and processes (see `engine_agents.sim`)."""
