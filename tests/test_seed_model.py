"""The Gimbal seed's model: the Qwen3-30B-A3B preset against its published config, and borrowed routing (the
ESFT trace's 26 x 64 top-6 selections under Qwen3's physics) keeping the model's totals, never implied."""

from __future__ import annotations

import pytest

from switchyard.shared.trace_files import load_trace
from switchyard.simulator.core.borrowed_routing import borrow_routing, overhead_scale
from switchyard.simulator.core.dp_engine import DPCost
from switchyard.simulator.core.physics import MODELS, MOE_LAYER_OVERHEAD_S, cost_model
from switchyard.simulator.offline.scenario import match_model, prepare
from tests.conftest import SHIPPED_DATA

ESFT = SHIPPED_DATA / "routing" / "esft_deepseek_v2_lite"
QWEN = MODELS["qwen3-30b-a3b"]


def test_qwen3_preset_is_the_published_config() -> None:
    # huggingface.co/Qwen/Qwen3-30B-A3B config.json: num_hidden_layers 48, num_experts 128, num_experts_per_tok 8,
    # hidden_size 2048, moe_intermediate_size 768, 32 attention / 4 KV heads, head_dim 128, vocab 151936, untied,
    # mlp_only_layers [] (every block routed), no shared expert.
    shape = (QWEN.num_layers, QWEN.moe_layers, QWEN.num_experts, QWEN.top_k, QWEN.hidden, QWEN.expert_ffn)
    assert shape == (48, 48, 128, 8, 2048, 768)
    assert (QWEN.q_heads, QWEN.kv_heads, QWEN.head_dim, QWEN.vocab) == (32, 4, 128, 151936)
    assert QWEN.shared_ffn == 0 and QWEN.dense_ffn == 0 and not QWEN.tie_embeddings
    total = QWEN.weight_bytes / 2  # bf16 parameters
    assert 30.4e9 < total < 30.6e9, "the model card's 30.5 B parameters"
    active = QWEN.dense_params + QWEN.moe_layers * QWEN.top_k * QWEN.expert_params + QWEN.vocab * QWEN.hidden
    assert 3.2e9 < active < 3.4e9, "the model card's 3.3 B activated"
    assert QWEN.kv_bytes_per_token == 48 * 2 * 4 * 128 * 2  # 96 KiB per token


def test_mismatched_shape_is_refused_unless_borrowing_is_asked_for() -> None:
    trace = load_trace(ESFT)
    with pytest.raises(ValueError, match="physics would not match its routing"):
        match_model(trace, "qwen3-30b-a3b")
    with pytest.raises(ValueError, match="needs a model preset"):
        match_model(trace, None, borrow_routing=True)
    assert match_model(trace, "deepseek-v2-lite", borrow_routing=True).name == "deepseek-v2-lite", "same shape: as is"
    spec = match_model(trace, "qwen3-30b-a3b", borrow_routing=True)
    assert spec.name == "qwen3-30b-a3b@26x64k6"
    assert (spec.moe_layers, spec.num_experts, spec.top_k) == (trace.num_layers, trace.num_experts, trace.top_k)


def test_borrowed_routing_keeps_the_models_totals() -> None:
    spec = borrow_routing(QWEN, (26, 64, 6))
    # Attention and KV are Qwen3's own.
    assert spec.kv_bytes_per_token == QWEN.kv_bytes_per_token and spec.num_layers == 48
    # A token's expert FLOPs over all layers, and the resident expert bytes, match Qwen3's (to rounding the width).
    flops = spec.moe_layers * spec.top_k * spec.expert_flops_per_token
    assert flops == pytest.approx(QWEN.moe_layers * QWEN.top_k * QWEN.expert_flops_per_token, rel=1e-3)
    experts = spec.moe_layers * spec.num_experts * spec.expert_bytes
    assert experts == pytest.approx(QWEN.moe_layers * QWEN.num_experts * QWEN.expert_bytes, rel=1e-9)
    # What it cannot keep: the router's weights are the trace's shape (under 1 % of the dense bytes).
    assert spec.dense_bytes == pytest.approx(QWEN.dense_bytes, rel=0.01) and spec.dense_bytes < QWEN.dense_bytes
    assert overhead_scale(QWEN, spec) == pytest.approx(48 / 26)
    with pytest.raises(ValueError, match="top-k <= experts"):
        borrow_routing(QWEN, (26, 4, 6))


def test_prepare_prices_a_step_like_the_model() -> None:
    sc = prepare(ESFT, model="qwen3-30b-a3b", gpu="H100", gpus=2, borrow_routing=True)
    assert sc.model.name == "qwen3-30b-a3b@26x64k6"
    assert sc.cost.moe_overhead_s * 26 == pytest.approx(MOE_LAYER_OVERHEAD_S * 48), "a step pays 48 layers' a"
    qwen_blocks = DPCost(cost_model(QWEN, "H100", 2), ep_ranks=4).kv_capacity_blocks
    assert DPCost(sc.cost, ep_ranks=4).kv_capacity_blocks == pytest.approx(qwen_blocks, rel=1e-3)
    # Every expert on every rank read once (a large batch): the same bytes as Qwen3's full expert set.
    full = sc.cost.b * sc.model.moe_layers * sc.model.num_experts
    assert full == pytest.approx(cost_model(QWEN, "H100", 2).b * 48 * 128, rel=1e-9)
