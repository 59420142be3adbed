"""The discrete-event simulator of MoE serving and its research harness, in two parts (core ← offline):

- `core`: the engine model: step physics (`physics`), expert replay from routing traces (`experts`), workloads
  (`workload`), the vLLM V1 scheduling model and the discrete-event loop, and the engines built on them
  (`xpyd_engines`: disaggregated prefill / decode; `dp_engine`: aggregated DP).
- `offline`: the discrete-event harness: the xPyD and DP front ends (`xpyd`, `dp`), scenarios, runs, metrics,
  plots and the `switchyard report` experiments (`report`, one module per section).

It needs only `shared` and `solver`: no bus, no HTTP. The live simulated engines, which are agents on the bus,
run this engine model from `engine_agents/sim/live`; the CLI runs the offline harness (`docs/simulator.md`).
"""
