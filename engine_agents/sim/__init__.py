"""Simulated MoE engines, in three parts that depend one way (core ← offline ← live):

- `core`: the engine model shared by everything that simulates: step physics (`physics`), expert replay from
  routing traces (`experts`), workloads (`workload`), the vLLM V1 scheduling model and the discrete-event loop,
  and the engines built on them (`xpyd_engines`: disaggregated prefill / decode; `dp_engine`: aggregated DP).
- `offline`: the discrete-event harness: the xPyD and DP front ends (`xpyd`, `dp`), scenarios, runs, metrics,
  plots and the `switchyard report` experiments.
- `live`: simulated engines that speak the bus and OpenAI HTTP in scaled real time, their load generators and
  processes.
"""
