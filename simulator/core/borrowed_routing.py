"""Running a model's physics on a routing trace of another model's shape ("borrowed routing").

Why: the expert selections of a simulated step must come from a real per-token routing trace, and the only
one shipped is ESFT's DeepSeek-V2-Lite trace (26 MoE layers × 64 experts, top-6). The Gimbal seed's model is
Qwen3-30B-A3B (48 × 128, top-8), for which no per-token trace is public. `scenario.match_model` refuses a
preset whose shape differs from the trace's, because per-layer distinct-expert counts of one shape priced
with another's expert sizes are wrong by the ratio of the shapes. This module is the explicit way round:
`borrow_routing(model, shape)` returns a *derived* preset that keeps the trace's routed shape (so every
expert selection, distinct-expert count, EP rank and placement is the trace's own) and the model's totals:

- attention, KV cache, embeddings and LM head: the model's own (`num_layers`, heads, `hidden`, `vocab`
  unchanged), so KV bytes per token, dense weight reads and attention FLOPs are the model's;
- routed experts: one trace expert stands for ``E_m·L_m / (E_t·L_t)`` of the model's experts. Its FFN width is
  set so a token's expert FLOPs over all layers equal the model's (``L_t·k_t·ffn' = L_m·k_m·ffn``), and its
  bytes per parameter so the resident expert bytes equal the model's (``L_t·E_t·ffn'·w' = L_m·E_m·ffn·w``);
- the per-MoE-layer fixed cost ``a`` is multiplied by ``L_m / L_t`` (`overhead_scale`), so a step pays the
  model's ``L_m·a``.

What it cannot keep (written down in docs/gimbal-seed.md): a step that touches few experts reads
``(E_m/k_m)/(E_t/k_t)`` (1.5× for Qwen3 on ESFT) more expert bytes than the model would, because a trace
expert is bigger than a model expert while a token touches fewer of them; a token's all-to-all sends go
over ``L_t`` layers (26) rather than ``L_m`` (48), about half the volume (a send per remote rank hosting one
of its experts, which top-6 of 64 and top-8 of 128 reach about as often); the router weights are the
trace's ``L_t·E_t·hidden`` (3.4 M parameters rather than 12.6 M, 18 MB of 2.5 GB of dense weights).
"""

from __future__ import annotations

from switchyard.simulator.core.physics import ModelSpec

__all__ = ["BORROW_SEPARATOR", "borrow_routing", "overhead_scale"]

#: Joins the model's and the trace's shape in a derived preset's name: ``qwen3-30b-a3b@26x64k6``.
BORROW_SEPARATOR = "@"


def borrow_routing(model: ModelSpec, shape: tuple[int, int, int]) -> ModelSpec:
    """`model` with the routed shape `shape` = (MoE layers, experts, top-k) and the model's totals (above)."""
    layers, experts, top_k = (int(v) for v in shape)
    if min(layers, experts, top_k) < 1 or top_k > experts:
        raise ValueError(f"a routing trace's shape must be positive with top-k <= experts, got {shape}")
    if model.dense_layers:
        raise ValueError(f"{model.name} has dense FFN blocks; borrowing a routed shape needs an all-MoE model")
    if (model.moe_layers, model.num_experts, model.top_k) == (layers, experts, top_k):
        return model
    ffn = round(model.moe_layers * model.top_k * model.expert_ffn / (layers * top_k))
    weight_bytes = (
        model.expert_weight_bytes * (model.moe_layers * model.num_experts * model.expert_ffn) / (layers * experts * ffn)
    )
    return model.with_(
        name=f"{model.name}{BORROW_SEPARATOR}{layers}x{experts}k{top_k}",
        moe_layers=layers,
        num_experts=experts,
        top_k=top_k,
        expert_ffn=ffn,
        expert_weight_bytes=weight_bytes,
        source=f"{model.source}; routed shape borrowed from a {layers}x{experts} top-{top_k} routing trace "
        f"(simulator.core.borrowed_routing: expert FLOPs and bytes per token and in total kept)",
    )


def overhead_scale(model: ModelSpec, borrowed: ModelSpec) -> float:
    """The factor on the per-MoE-layer fixed cost that keeps the model's per-step total (L_m / L_t)."""
    return model.moe_layers / borrowed.moe_layers
