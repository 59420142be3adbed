"""The step-time physics: calibrated to the seed's microbenchmark, monotone in distinct experts, sized from configs."""

from __future__ import annotations

import numpy as np
import pytest

from switchyard.simulator.core.physics import (
    GPUS,
    MODELS,
    SEED_FIG2,
    calibrate_moe_overhead,
    cost_model,
)


def test_seed_microbenchmark_ratio_holds() -> None:
    """16 -> 128 active experts at batch 64 multiplies MoE-layer time by the seed's 4.7x (MI300X, Qwen3)."""
    c = cost_model(SEED_FIG2["model"], SEED_FIG2["gpu"])
    lo, hi = c.moe_time(np.array([16, 128]), SEED_FIG2["batch"])
    assert hi / lo == pytest.approx(SEED_FIG2["ratio"], rel=1e-9)
    # b is the datasheet streaming time of one expert, not a fitted number
    assert c.b == pytest.approx(3 * 2048 * 768 * 2 / 5.3e12)


def test_batch_size_is_nearly_but_not_exactly_flat() -> None:
    c = cost_model("qwen3-30b-a3b", "MI300X")
    for experts in (16, 64, 128):
        t = c.moe_time(np.array([experts]), np.array([16, 64, 128]))[:, 0]
        assert np.all(np.diff(t) > 0), "compute must make batch size matter a little"
        assert t[-1] / t[0] < 1.15, "an 8x larger batch at fixed experts must stay nearly flat (vs 4.7x for experts)"


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("gpu", sorted(GPUS))
def test_step_time_strictly_monotone_in_distinct_experts(model: str, gpu: str) -> None:
    c = cost_model(model, gpu)
    layers, experts = c.model.moe_layers, c.model.num_experts
    rng = np.random.default_rng(0)
    base = rng.integers(1, experts, layers)
    ctx = rng.integers(1, 4000, 8)
    t0 = c.decode_time(base, 8, ctx)
    for layer in rng.choice(layers, 3, replace=False):
        more = base.copy()
        more[layer] += 1
        assert c.decode_time(more, 8, ctx) > t0
    # more context and more tokens cost more too
    assert c.decode_time(base, 8, ctx + 100) > t0
    assert c.decode_time(base, 9, np.append(ctx, 1)) > t0


@pytest.mark.parametrize("model", sorted(MODELS))
def test_fast_path_equals_per_layer_model(model: str) -> None:
    c = cost_model(model, "H200")
    rng = np.random.default_rng(1)
    distinct = rng.integers(1, c.model.num_experts, c.model.moe_layers)
    ctx = rng.integers(1, 3000, 13)
    context = ctx if c.model.sliding_layers else int(ctx.sum())
    for recompute in (0, 700):
        expected = c.decode_time(distinct, 13, ctx, prefill_tokens=recompute)
        got = c.decode_time_total(int(distinct.sum()), 13, context, prefill_tokens=recompute)
        assert got == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize(
    ("model", "published_params"),
    [("qwen3-30b-a3b", 30.5e9), ("deepseek-v2-lite", 15.7e9), ("gpt-oss-120b", 116.8e9), ("llama4-maverick", 400e9)],
)
def test_presets_match_published_parameter_counts(model: str, published_params: float) -> None:
    """Derived sizes from the config fields add up to each model card's total (within 3%)."""
    m = MODELS[model]
    experts = m.moe_layers * m.num_experts * m.expert_params
    embed = 0 if m.tie_embeddings else m.vocab * m.hidden
    assert experts + m.dense_params + embed == pytest.approx(published_params, rel=0.03)


def test_kv_bytes_per_token() -> None:
    assert MODELS["qwen3-30b-a3b"].kv_bytes_per_token == 96 * 1024  # DESIGN.md's figure
    assert MODELS["deepseek-v2-lite"].kv_bytes_per_token == 27 * (512 + 64) * 2  # MLA latent + rope key


def test_sliding_window_caps_kv_reads() -> None:
    c = cost_model("gpt-oss-120b", "H100")
    short, long = c.kv_read_time(np.array([100])), c.kv_read_time(np.array([10_000]))
    full_layers = c.model.num_layers - c.model.sliding_layers
    per = c.kv_read_s_per_token
    assert long - short == pytest.approx(
        (10_000 - 100) * full_layers * per + (128 - 100) * c.model.sliding_layers * per
    )


def test_kv_capacity_and_fit() -> None:
    small, big = cost_model("qwen3-30b-a3b", "H100"), cost_model("qwen3-30b-a3b", "MI300X")
    assert 0 < small.kv_capacity_blocks < big.kv_capacity_blocks
    with pytest.raises(ValueError, match="does not fit"):
        _ = cost_model("llama4-maverick", "H100", gpus=1).kv_capacity_blocks


def test_calibration_rejects_unreachable_ratio() -> None:
    with pytest.raises(ValueError):
        calibrate_moe_overhead(ratio=9.0)  # > 128/16: needs a negative fixed cost
    with pytest.raises(ValueError):
        calibrate_moe_overhead(ratio=1.0)


def test_expert_parallel_splits_dense_and_transfer() -> None:
    one, eight = cost_model("qwen3-30b-a3b", "H100", gpus=1), cost_model("qwen3-30b-a3b", "H100", gpus=8)
    assert eight.dense_read_s == pytest.approx(one.dense_read_s / 8)
    assert eight.kv_transfer_time(1000) == pytest.approx(one.kv_transfer_time(1000) / 8)
    assert one.kv_transfer_time(1000) == pytest.approx(1000 * 96 * 1024 / 50e9)


def test_bracketing_cost_terms_add_what_they_say_and_the_fast_path_keeps_them() -> None:
    """Step overhead adds its seconds once per step; all-to-all reproduces DeepEP's published EP8 figure;
    HBM efficiency slows every read; the fast path and the per-layer model agree with all of them on."""
    base = cost_model("deepseek-v2-lite", "MI300X")
    distinct = np.full(base.model.moe_layers, 20)
    plain = base.decode_time(distinct, 32, 32 * 500)
    with_overhead = cost_model("deepseek-v2-lite", "MI300X", step_overhead_s=2e-3)
    assert with_overhead.decode_time(distinct, 32, 32 * 500) == pytest.approx(plain + 2e-3, rel=1e-12)
    # DeepEP low-latency, EP8: 128 tokens x top-8 x hidden 7168, dispatch 77 µs + combine 114 µs per layer
    v3_like = cost_model("qwen3-30b-a3b", "H100", a2a=True).model.with_(hidden=7168, top_k=8, moe_layers=1)
    one_layer = cost_model(v3_like, "H100", a2a=True)
    assert one_layer.extra_time(128) == pytest.approx(191e-6, rel=0.15)
    slow = cost_model("deepseek-v2-lite", "MI300X", hbm_efficiency=0.7)
    assert slow.b == pytest.approx(base.b / 0.7) and slow.decode_time(distinct, 32, 32 * 500) > plain
    every = cost_model("deepseek-v2-lite", "MI300X", step_overhead_s=1e-3, a2a=True, hbm_efficiency=0.8)
    expected = every.decode_time(distinct, 32, 32 * 500, prefill_tokens=100)
    assert every.decode_time_total(int(distinct.sum()), 32, 32 * 500, prefill_tokens=100) == pytest.approx(expected)
    assert expected > plain + 1e-3
    with pytest.raises(ValueError, match="hbm_efficiency"):
        cost_model("deepseek-v2-lite", "MI300X", hbm_efficiency=1.5)
